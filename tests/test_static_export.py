"""A user's first export, `torch.onnx.export(model, (ids,), "m.onnx", dynamo=True)`: static shapes, the
position table folded to the traced positions. The traced batch is one micro-step's batch: accumulation
and pipeline micro-batches plan on it, the folded table trains as the rows it is, and its checkpoints
load under another plan. Checked against one process that takes the same micro-batches."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import main
from core.graph import Fold
from executor.launch import run
from executor.preflight import RunOptions
from planner.graph import load_graph

BATCH, SEQ = 4, 16


@pytest.fixture(scope="session")
def static_gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GPT-2 (2 layers, random weights) exported as a user does first: plain dynamo export, no dynamic dims."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("static") / "gpt2-static.onnx"
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=64, use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQ))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (ids,), str(path), dynamo=True)
        # The module's own logits beside the file: what the executor's reading of it must give.
        torch.save({"ids": ids, "logits": model(ids).logits.detach()}, path.with_suffix(".pt"))
    return path


def _plan(model: Path, out: Path, *args: str) -> dict:
    r = CliRunner().invoke(main, ["plan", str(model), "--profile", "cpu", "-o", str(out), *args])
    assert r.exit_code == 0, r.output
    return json.loads(out.read_text())


def test_the_default_export_is_static_with_a_folded_position_table(static_gpt2: Path) -> None:
    graph = load_graph(static_gpt2)  # no dim to bind
    assert graph.tensors[graph.inputs[0]].shape == (BATCH, SEQ)
    folded = [p for p in graph.parameters.values() if p.fold is Fold.STATIC]
    assert [p.origin for p in folded] == ["transformer.wpe.weight"]
    assert graph.tensors[folded[0].name].shape[-2:] == (SEQ, 32)  # the traced positions' rows of 64


def test_the_interpreter_reads_the_folded_table_as_the_module_holds_it(static_gpt2: Path) -> None:
    """The file's model equals the torch module it came from (the table's first SEQ rows, no others):
    the one-process reference `--verify` compares with cannot share a misreading of it."""
    import torch

    from executor.interpreter import load_module

    saved = torch.load(static_gpt2.with_suffix(".pt"))
    with torch.no_grad():
        logits = load_module(static_gpt2, {})(saved["ids"])
    out = logits[0] if isinstance(logits, (list, tuple)) else logits
    assert torch.allclose(out, saved["logits"], atol=1e-5)


def test_accumulation_on_a_static_export(static_gpt2: Path, tmp_path: Path) -> None:
    s = _plan(static_gpt2, tmp_path / "s.json", "--devices", "2", "--accumulation-steps", "2")
    assert s["training"]["micro_batches"] == 2 and s["training"]["global_batch_size"] == 2 * BATCH
    # The global batch, over the traced (micro-step) batch: the same plan.
    g = _plan(static_gpt2, tmp_path / "g.json", "--devices", "2", "--global-batch-size", str(2 * BATCH))
    assert g["training"]["micro_batches"] == 2 and g["nodes"] == s["nodes"]


def test_a_pipeline_on_a_static_export(static_gpt2: Path, tmp_path: Path) -> None:
    s = _plan(static_gpt2, tmp_path / "s.json", "--devices", "4", "--layout", "pp=2,dp_replicate=2")
    assert len(s["pipeline"]["stages"]) == 2 and s["training"]["micro_batches"] == 1
    assert s["training"]["global_batch_size"] == BATCH and s["training"]["micro_batch_size"] == BATCH // 2


@pytest.mark.parametrize(("args", "says"), [
    (["--devices", "2", "--global-batch-size", "6"], "not a multiple of the model's static batch 4"),
    (["--devices", "2", "--global-batch-size", "8", "--accumulation-steps", "4"], "is 2 micro-steps; give one"),
])
def test_static_batch_errors_say_what_to_do(static_gpt2: Path, tmp_path: Path, args: list[str], says: str) -> None:
    r = CliRunner().invoke(main, ["plan", str(static_gpt2), "--profile", "cpu", "-o", str(tmp_path / "s.json"), *args])
    assert r.exit_code == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.slow
def test_a_static_export_trains_as_one_process_and_its_checkpoint_loads_under_tensor_parallelism(
        static_gpt2: Path, tmp_path: Path) -> None:
    """About 20 s: a data-parallel plan with 2 micro-steps runs and verifies, saves; a tensor-parallel
    plan (the MLP split, Megatron's column/row) loads it and continues as the one process would."""
    dp = tmp_path / "dp.json"
    _plan(static_gpt2, dp, "--devices", "2", "--mode", "data-parallel", "--accumulation-steps", "2", "--zero", "0")
    ck = tmp_path / "ck"
    r = run(str(dp), str(static_gpt2), nproc=2, opts=RunOptions(steps=1, warmup=1, verify=True, save=str(ck)),
            timeout_s=240)
    assert r["max_abs_diff"] < 1e-5, r
    assert r["collectives_executed"] == r["collectives_planned"]
    graph = load_graph(static_gpt2)
    table = next(p.name for p in graph.parameters.values() if p.fold is Fold.STATIC)
    folded = json.loads((ck / "meshplan.json").read_text())["folded"]  # the rows saved, by the module's name
    assert folded == {table: {"origin": "transformer.wpe.weight", "shape": [1, SEQ, 32]}}
    fc, proj = (next(p.name for p in graph.parameters.values() if p.origin == f"transformer.h.0.mlp.{m}.weight")
                for m in ("c_fc", "c_proj"))
    tp = tmp_path / "tp.json"
    s = _plan(static_gpt2, tp, "--devices", "2", "--mode", "semi", "--accumulation-steps", "2", "--zero", "0",
              "--pin", f"{fc}=S(1)", "--pin", f"{proj}=S(0)")
    assert s["tensors"][fc]["placements"] == ["S(1)"]
    r2 = run(str(tp), str(static_gpt2), nproc=2, opts=RunOptions(steps=1, warmup=1, verify=True, load=str(ck)),
             timeout_s=240)
    assert r2["optimizer_steps_before"] == 3 and r2["max_abs_diff"] < 1e-5, r2
