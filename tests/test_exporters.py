"""The importer on what users export, not only on the zoo's recipe: torch.onnx.export's defaults
(dynamo, optimize=True), optimize=False, `meshplan export`'s shape-only files, and a shape-only file
written by another recipe without metadata. The truths checked come from torch, not from meshplan:
the module's `sum(p.numel())`, and its own forward output and gradients on the same weights."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch
from click.testing import CliRunner

from bench.zoo import ZOO, _example
from cli import main
from core.errors import ModelError
from core.graph import Fold
from executor.interpreter import OnnxModule
from executor.launch import check_executable, run
from executor.preflight import RunOptions
from meshplan import export as meshplan_export
from planner.graph import load_graph, load_model_proto
from planner.params import normalize
from planner.search.plan import make_plan
from planner.search.request import PlanRequest

pytestmark = pytest.mark.zoo
MODELS = ["gpt2-tiny", "bert-tiny", "llama-tiny", "vit-tiny", "mlp"]
WAYS = ["default", "no-optimize", "meshplan-export", "no-metadata"]


def _module(name: str, device: str = "cpu") -> tuple[Any, torch.Tensor, dict[str, int]]:
    entry = ZOO[name]
    torch.manual_seed(0)
    with torch.device(device):
        module, _ = entry.build()
    module.eval()
    dims = {d: entry.example_dims[d] for d in entry.input_dims if isinstance(d, str)}
    return module, _example(entry, device), dims


def _dynamic(name: str, x: torch.Tensor) -> tuple[dict[int, Any], ...]:
    entry = ZOO[name]
    return ({i: torch.export.Dim(d, max=entry.dim_max.get(d, 1 << 20)) for i, d in enumerate(entry.input_dims)
             if isinstance(d, str)},)


def _write(name: str, way: str, out: Path) -> Path:
    module, x, _ = _module(name)
    path = out / f"{name}-{way}.onnx"
    if way == "default":  # what the torch docs show: the defaults (optimize=True), dynamic batch/seq
        torch.onnx.export(module, (x,), str(path), dynamo=True, dynamic_shapes=_dynamic(name, x))
    elif way == "no-optimize":
        torch.onnx.export(module, (x,), str(path), dynamo=True, dynamic_shapes=_dynamic(name, x), optimize=False)
    elif way == "meshplan-export":
        meta, mx, _ = _module(name, "meta")
        entry = ZOO[name]
        meshplan_export(meta, (mx,), path, dynamic=[tuple(d if isinstance(d, str) else None for d in entry.input_dims)],
                        dim_max=entry.dim_max)
    else:
        _no_metadata_recipe(module, x, name, path)
    return path


def _no_metadata_recipe(module: Any, x: torch.Tensor, name: str, path: Path) -> None:
    """Another team's shape-only recipe: saved without initializers, every weight the graph reads then
    declared as an initializer whose external data is absent, and every metadata property stripped
    (no parameter kinds, no fx nodes, no module paths)."""
    prog = torch.onnx.export(module, (x,), dynamo=True, dynamic_shapes=_dynamic(name, x), optimize=False)
    assert prog is not None
    raw = path.with_suffix(".bare.onnx")
    prog.save(str(raw), include_initializers=False)
    proto = onnx.load(str(raw))
    g = proto.graph
    state = {**dict(module.named_parameters(remove_duplicate=False)), **dict(module.named_buffers())}
    produced = {o for n in g.node for o in n.output} | {v.name for v in g.input}
    for t_name in sorted({t for n in g.node for t in n.input if t and t not in produced}):
        t = state[t_name]
        elem = onnx.helper.np_dtype_to_tensor_dtype(torch.empty(0, dtype=t.dtype).numpy().dtype)
        init = onnx.TensorProto(name=t_name, dims=list(t.shape), data_type=elem)
        init.data_location = onnx.TensorProto.EXTERNAL
        for k, val in (("location", "absent.bin"), ("offset", "0"), ("length", str(t.numel() * t.element_size()))):
            init.external_data.add(key=k, value=val)
        g.initializer.append(init)
    for item in (*g.input, *g.value_info, *g.output, *g.node):
        del item.metadata_props[:]
    onnx.save(proto, str(path))


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    out = tmp_path_factory.mktemp("exports")
    cache: dict[tuple[str, str], Path] = {}

    def get(name: str, way: str) -> Path:
        if (name, way) not in cache:
            cache[(name, way)] = _write(name, way, out)
        return cache[(name, way)]

    return get


def _torch_count(name: str) -> int:
    module, _, _ = _module(name, "meta")
    return sum(p.numel() for p in module.parameters())  # a tied weight once


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("name", MODELS)
def test_parameter_count_equals_torch(name: str, way: str, exports: Callable[[str, str], Path]) -> None:
    _, _, dims = _module(name, "meta")
    g = load_graph(exports(name, way), dims)
    assert g.num_params == _torch_count(name)
    assert all(p.fold is not Fold.STATIC for p in g.parameters.values())


@pytest.mark.parametrize("name", MODELS)
def test_default_export_trains_the_modules_parameters(name: str, exports: Callable[[str, str], Path]) -> None:
    """The interpreter on the optimize=True export against the torch module itself: same output, and
    every parameter's gradient equals the gradient of the torch parameter it stands for — a merged
    bias trained once for all layers, or a dropped one not trained, would differ here."""
    module, x, dims = _module(name)
    path = exports(name, "default")
    g = load_graph(path, dims)
    om = OnnxModule(g, load_model_proto(path), base_dir=path.parent)
    assert sum(p.numel() for p in om.params.values()) == sum(p.numel() for p in module.parameters())
    y_ref, y = module(x), om(x)
    assert torch.allclose(y, y_ref, atol=1e-5)
    y_ref.square().mean().backward()
    y.square().mean().backward()
    by_name = {normalize(k): p for k, p in module.named_parameters(remove_duplicate=False)}
    seen = set()
    for name_, p in g.parameters.items():
        ref = by_name[normalize(p.origin)]
        grad = ref.grad.T if p.fold is Fold.LAYOUT else ref.grad  # a folded transpose of a weight
        assert torch.allclose(om.parameter(name_).grad, grad, atol=1e-5, rtol=1e-4), name_
        seen.add(id(ref))
    assert seen == {id(p) for p in module.parameters()}  # every torch parameter is trained, once


def test_static_default_export_names_its_folded_parameter(tmp_path: Path) -> None:
    """torch.onnx.export(m, (ids,), path, dynamo=True) with no dynamic shapes folds BERT's position
    table to the rows its static seq reads: planned and trained at that shape, with a note (`run` takes it:
    the rows are what the file's model reads)."""
    module, x, dims = _module("bert-tiny")
    path = tmp_path / "bert-static.onnx"
    torch.onnx.export(module, (x,), str(path), dynamo=True)
    g = load_graph(path, {})
    table = module.model.bert.embeddings.position_embeddings.weight
    seq, hidden = x.shape[1], table.shape[1]
    assert g.num_params == _torch_count("bert-tiny") - table.numel() + seq * hidden
    assert any("position_embeddings" in n and "static shapes" in n for n in g.notes)
    check_executable(g)  # trains as the rows it is (tests/test_static_export.py runs it against one process)


def test_weight_inputs_without_declarations_are_one_error(tmp_path: Path) -> None:
    module, x, dims = _module("mlp")
    prog = torch.onnx.export(module, (x,), dynamo=True, dynamic_shapes=_dynamic("mlp", x))
    assert prog is not None
    path = tmp_path / "bare.onnx"
    prog.save(str(path), include_initializers=False)  # the weights are read, and declared nowhere
    assert not onnx.load(str(path)).graph.initializer
    with pytest.raises(ModelError, match=r"^4 weight inputs have no declaration: fc1\.weight, fc1\.bias, fc2\.weight, …"):
        load_graph(path, dims)
    r = CliRunner().invoke(main, ["inspect", str(path), "--dim", "batch=4"])
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1 and "include_initializers" in r.output


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2-tiny", "bert-tiny", "llama-tiny"])
def test_default_export_runs_distributed_equal_to_one_process(name: str, exports: Callable[[str, str], Path],
                                                             tmp_path: Path) -> None:
    """The optimize=True export trained on 2 gloo ranks (the ILP's plan) equals one process, trains
    exactly torch's parameter count, and runs the collectives it planned."""
    path = exports(name, "default")
    dims = {"batch": 8, "seq": 32}
    strategy, _ = make_plan(PlanRequest(model=str(path), dims=dims, profile="cpu", devices=2, mode="data-parallel"))
    out = tmp_path / "s.json"
    strategy.save(out)
    r = run(str(out), str(path), nproc=2, opts=RunOptions(steps=1, warmup=0, verify=True, optimizer="sgd"))
    assert r["trained_parameters"] == _torch_count(name)
    assert r["max_abs_diff"] < 1e-5
    assert r["collectives_executed"] == r["collectives_planned"]


def test_legacy_default_export_says_batchnorm_was_folded(tmp_path: Path) -> None:
    """The TorchScript exporter's defaults (eval mode, constant folding) fold BatchNormalization into
    the Conv weights (renamed onnx::Conv_NN): the normalisation parameters are gone from the file,
    and the import says so instead of silently counting fewer parameters."""
    from bench.zoo import ConvNet, _randomize_norm_state

    module = ConvNet().eval()
    _randomize_norm_state(module)  # a fresh BatchNorm fuses to equal (zero) biases, which this exporter merges
    path = tmp_path / "legacy.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.randn(2, 3, 32, 32),), str(path), dynamo=False)
    g = load_graph(path, {})
    bn = sum(p.numel() for m in module.modules() if isinstance(m, torch.nn.BatchNorm2d) for p in m.parameters())
    fused_biases = sum(m.out_channels for m in module.modules() if isinstance(m, torch.nn.Conv2d))
    assert g.num_params == sum(p.numel() for p in module.parameters()) - bn + fused_biases
    assert any("BatchNormalization folded into Conv" in n for n in g.notes)


@pytest.mark.parametrize("way", WAYS)
def test_keys_and_values_gathered_before_their_repeat_on_every_export(way: str,
                                                                      exports: Callable[[str, str], Path]) -> None:
    """Context parallelism's all-gather design on llama-tiny (4 query heads on 2 KV heads of 16, batch 1,
    32 tokens, cp=4) as each exporter writes it: the nodes that only move, repeat or scale the keys and
    values (`core.context.key_value_feeds`) found on every export, so that k and v are gathered over cp
    before grouped-query attention's repeat — each all-gather b·kv_heads·s·head_dim·4 = 4096 bytes — and
    nothing runs on cp at the attention products."""
    from core.placement import Replicate
    from tests.test_context_parallel import planned_feeds

    s, _, regions, feeds = planned_feeds(exports("llama-tiny", way))
    cp = s.mesh.axis_names.index("cp")
    gathers = sorted((e.kind.value, e.phase.value, e.size_bytes) for n in feeds for e in s.nodes[n].collectives)
    # k and v of each of the 2 layers, at their unrepeated size: gathered forward, reduce-scattered backward
    assert gathers == sorted([("all_gather", "forward", 4096.0), ("reduce_scatter", "backward", 4096.0)] * 4), way
    for r in regions.values():
        for t, mm in ((r.kt, r.nodes[0]), (r.v, r.nodes[-1])):
            assert isinstance(s.tensors[t].spec.placements[cp], Replicate)
            assert not s.nodes[mm].collectives and not [x for x in s.reshards if x.consumer == mm]
