"""Every zoo export imports: parameter counts equal torch's, FLOPs equal the analytic count."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from bench.zoo import BENCH_ONLY, ZOO
from costmodel.flops import graph_flops
from costmodel.summary import graph_summary
from planner.graph import load_graph

TRANSFORMER_LAYERS = {"gpt2-tiny": 2, "gpt2-medium": 24, "bert-tiny": 2, "vit-tiny": 2, "llama-tiny": 2,
                      "llama3-8b": 32, "llama3-70b": 80}


@pytest.mark.parametrize("name", [n for n in ZOO if n not in BENCH_ONLY])
def test_inspect_every_zoo_model(name: str, zoo: Callable[[str], Path], zoo_meta: Callable[[str], dict]) -> None:
    path = zoo(name)
    meta = zoo_meta(name)
    g = load_graph(path, meta["example_dims"])
    s = graph_summary(g)
    for key in ("nodes", "op_types", "parameters", "parameter_bytes", "flops_forward", "inputs", "outputs", "layers"):
        assert key in s
    # Parameters: torch's sum(p.numel()) with tied weights counted once, exactly.
    assert s["parameters"] == meta["num_params"]
    assert s["flops_forward"] > 0
    if name in TRANSFORMER_LAYERS:
        assert s["layers"][0]["num_layers"] == TRANSFORMER_LAYERS[name]


def _gpt2_forward_flops(cfg: dict, b: int, s: int) -> float:
    # Per layer, matmul FLOPs 2·(tokens)·(12h²) for QKV (3h²), out-proj (h²) and the MLP (8h²),
    # plus attention scores QKᵀ and context AV: 2·B·s²·h each; then the tied LM head 2·tokens·V·h.
    h, n_layer, v = cfg["n_embd"], cfg["n_layer"], cfg["vocab_size"]
    tokens = b * s
    return n_layer * (2 * tokens * 12 * h * h + 4 * b * s * s * h) + 2 * tokens * v * h


def _llama_forward_flops(cfg: dict, b: int, s: int) -> float:
    # q and o: h², k and v: h·(kv_heads·head_dim) each (GQA), gated MLP 3·h·ffn; attention 4·B·s²·h
    # (all heads together span h); untied LM head 2·tokens·V·h. Rotary's tiny matmul is left out.
    h, n_layer, v = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    ffn, heads = cfg["intermediate_size"], cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads) * (h // heads)
    tokens = b * s
    per_layer = 2 * tokens * (2 * h * h + 2 * h * kv + 3 * h * ffn) + 4 * b * s * s * h
    return n_layer * per_layer + 2 * tokens * v * h


@pytest.mark.parametrize(
    ("name", "dims", "analytic"),
    [
        ("gpt2-tiny", {"batch": 4, "seq": 32}, _gpt2_forward_flops),
        ("gpt2-medium", {"batch": 8, "seq": 1024}, _gpt2_forward_flops),
        ("llama-tiny", {"batch": 4, "seq": 32}, _llama_forward_flops),
        ("llama3-8b", {"batch": 1, "seq": 8192}, _llama_forward_flops),
    ],
)
def test_forward_flops_match_analytic(name: str, dims: dict[str, int], analytic: Callable[[dict, int, int], float],
                                      zoo: Callable[[str], Path], zoo_meta: Callable[[str], dict]) -> None:
    g = load_graph(zoo(name), dims)
    cfg = zoo_meta(name)["config"]
    defaults = {"n_embd": 768, "n_layer": 12, "vocab_size": 50257}  # GPT2Config defaults omitted by to_diff_dict
    expected = analytic({**defaults, **cfg}, dims["batch"], dims["seq"])
    assert graph_flops(g).matmul == pytest.approx(expected, rel=0.02)


def test_legacy_export_module_paths(zoo: Callable[[str], Path]) -> None:
    g = load_graph(zoo("convnet-legacy"), {"batch": 2})
    paths = {n.module_path for n in g.compute_nodes}
    assert "stages.0.1.conv1" in paths
    assert g.layers[0].prefix == "stages.0" and g.layers[0].indices == (0, 1)
