"""`meshplan export`: shape-only files from transformers configs, deep stacks by layer repetition
checked against a full-depth export, and its bad input as one line."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import onnx
import pytest
import torch
from click.testing import CliRunner

from cli import main
from costmodel.flops import graph_flops
from executor.interpreter import OnnxModule
from planner.export import _export_file, export_config, hf_model, load_hf_config
from planner.graph import load_graph, load_model_proto
from planner.replicate import replicate_layers

pytestmark = pytest.mark.zoo
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 160,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 6, "vocab_size": 128,
         "max_position_embeddings": 256, "tie_word_embeddings": False}


def _config(tmp_path: Path, **overrides: object) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, **overrides}))
    return path


def test_cli_export_counts_torch_parameters(tmp_path: Path) -> None:
    out = tmp_path / "llama.onnx"
    r = CliRunner().invoke(main, ["export", "--hf-config", str(_config(tmp_path)), "--dim", "batch", "--dim", "seq",
                                  "-o", str(out)])
    assert r.exit_code == 0, r.output
    model, _ = hf_model(load_hf_config(_config(tmp_path)))
    expected = sum(p.numel() for p in model.parameters())
    assert f"{expected:,} parameters" in r.output and "2 → 6" in r.output
    g = load_graph(out, {"batch": 2, "seq": 32})
    assert g.num_params == expected
    assert g.layers[0].num_layers == 6
    assert all(init.data_location == onnx.TensorProto.EXTERNAL for init in load_model_proto(out).graph.initializer)


def test_repeated_layers_equal_a_full_depth_export(tmp_path: Path) -> None:
    """The 6-layer graph made from a 2-layer export has the full export's ops, parameters (by name
    and shape) and FLOPs."""
    config = load_hf_config(_config(tmp_path))
    repeated = export_config(config, tmp_path / "rep.onnx").path
    full_model, _ = hf_model(load_hf_config(_config(tmp_path)))
    x = torch.zeros(2, 16, dtype=torch.long, device="meta")
    _export_file(full_model, (x,), tmp_path / "full.onnx", dynamic=[("batch", "seq")], weights=False, dim_max={})
    dims = {"batch": 2, "seq": 32}
    a, b = load_graph(repeated, dims), load_graph(tmp_path / "full.onnx", dims)
    assert Counter(n.op_type for n in a.compute_nodes) == Counter(n.op_type for n in b.compute_nodes)
    assert {(p.name, p.shape) for p in a.params} == {(p.name, p.shape) for p in b.params}
    assert graph_flops(a) == graph_flops(b)


# DeepSeek-V3's shape at toy size: 2 dense layers, then layers of 8 routed experts (top-2 in 2 groups)
# beside a shared one.
DEEPSEEK = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
            "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 7, "first_k_dense_replace": 2,
            "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 128, "n_routed_experts": 8,
            "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "q_lora_rank": 32,
            "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
            "max_position_embeddings": 256, "tie_word_embeddings": False}


def test_repeated_layers_keep_the_first_layers_built_otherwise(tmp_path: Path) -> None:
    """A model whose first layers differ from the rest (DeepSeek-V3's dense layers before its experts) is
    exported with those and two of the rest, the last repeated: the full export's ops, parameters and
    FLOPs, torch's parameter count, and an experts block in every layer after the dense ones."""
    from core.experts import find_expert_blocks

    path = tmp_path / "config.json"
    path.write_text(json.dumps(DEEPSEEK))
    report = export_config(load_hf_config(path), tmp_path / "rep.onnx")
    assert report.repeated_layers == "model.model.layers: 4 → 7"
    full_model, _ = hf_model(load_hf_config(path))
    x = torch.zeros(2, 16, dtype=torch.long, device="meta")
    _export_file(full_model, (x,), tmp_path / "full.onnx", dynamic=[("batch", "seq")], weights=False, dim_max={})
    dims = {"batch": 2, "seq": 32}
    a, b = load_graph(report.path, dims), load_graph(tmp_path / "full.onnx", dims)
    assert Counter(n.op_type for n in a.compute_nodes) == Counter(n.op_type for n in b.compute_nodes)
    assert {(p.name, p.shape) for p in a.params} == {(p.name, p.shape) for p in b.params}
    assert a.num_params == report.num_params == sum(p.numel() for p in full_model.parameters())
    assert graph_flops(a) == graph_flops(b)
    assert [blk.module for blk in find_expert_blocks(a)] == [f"model.model.layers.{i}.mlp" for i in range(2, 7)]


def test_repeated_layers_compute_what_the_module_computes(tmp_path: Path) -> None:
    """With weights: a 2-layer export repeated to 4 layers runs like a 4-layer torch model whose
    layers 2 and 3 hold layer 1's weights."""
    torch.manual_seed(0)
    config = load_hf_config(_config(tmp_path, num_hidden_layers=4))
    deep, _ = hf_model(config)
    deep = deep.to_empty(device="cpu")
    for p in deep.parameters():
        torch.nn.init.normal_(p, std=0.05)
    shallow, _ = hf_model(load_hf_config(_config(tmp_path, num_hidden_layers=4)), num_layers=2)
    shallow = shallow.to_empty(device="cpu")
    for layer in (2, 3):
        deep.model.model.layers[layer].load_state_dict(deep.model.model.layers[1].state_dict())
    state = deep.state_dict()
    shallow.load_state_dict({k: v for k, v in state.items() if not k.startswith(("model.model.layers.2",
                                                                                   "model.model.layers.3"))})
    for module in (deep, shallow):  # buffers (rotary inv_freq) are not in a meta model's weights
        module.model.model.rotary_emb.__init__(config=module.model.config)
    ids = torch.randint(0, 128, (2, 16))
    path = tmp_path / "two.onnx"
    _export_file(shallow, (ids,), path, dynamic=[("batch", "seq")], weights=True, dim_max={})
    proto = replicate_layers(onnx.load(str(path)), "model.model.layers", 4)
    onnx.save(proto, str(tmp_path / "four.onnx"))
    g = load_graph(tmp_path / "four.onnx", {"batch": 2, "seq": 16})
    y = OnnxModule(g, proto)(ids)
    torch.testing.assert_close(y, deep(ids), atol=1e-5, rtol=1e-4)


def test_export_bad_input_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    not_hf = tmp_path / "other.json"
    not_hf.write_text(json.dumps({"hidden": 64}))
    cases = [
        (["--hf-config", str(not_hf)], "not a transformers config"),
        (["--hf-config", str(tmp_path / "missing.json")], "no such file"),
        (["--hf-config", str(_config(tmp_path)), "--dim", "tokens"], "input dims are batch, seq"),
    ]
    for args, message in cases:
        r = runner.invoke(main, ["export", *args, "-o", str(tmp_path / "m.onnx")])
        assert r.exit_code == 2, r.output
        assert message in r.output and len(r.output.strip().splitlines()) == 1, r.output
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if the extra were not installed
    r = runner.invoke(main, ["export", "--hf-config", str(_config(tmp_path)), "-o", str(tmp_path / "m.onnx")])
    assert r.exit_code == 2 and "pip install 'meshplan[hf]'" in r.output
    assert len(r.output.strip().splitlines()) == 1
