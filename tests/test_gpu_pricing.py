"""Pricing a GPU step as torch runs it: autocast's dtypes against torch's own, a compiled runtime's
fused chains, the precisions and runtime recorded in the strategy, and one H100's whole steps
(bench/gpu/h100/steps.json) against plans priced on the profile fitted from its microbenchmarks."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path

import pytest

from costmodel.autocast import dtypes
from costmodel.fusion import fusion_chains, internal_tensors
from costmodel.memory import PRECISIONS
from costmodel.step import CostModel
from hwprofiles.files import load_profile
from planner.graph import load_graph
from planner.search.plan import make_plan
from planner.search.request import PlanRequest
from planner.strategy import from_json

pytestmark = pytest.mark.zoo


def test_autocast_dtypes_are_torchs(zoo: Callable[[str], Path]) -> None:
    """gpt2-tiny under torch.autocast("cpu", bfloat16): each module's output dtype as torch makes it
    (forward hooks) is the one `autocast.dtypes` gives the graph's last tensor of that module."""
    import torch

    from bench.zoo import ZOO

    model, _ = ZOO["gpt2-tiny"].build()
    seen: dict[str, torch.dtype] = {}
    for name, mod in model.named_modules():
        if name and not any(True for _ in mod.children()):  # leaf modules: their own ops
            mod.register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, out.dtype)
                                      if isinstance(out, torch.Tensor) else None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randint(0, 256, (2, 16)))
    graph = load_graph(zoo("gpt2-tiny"), {"batch": 2, "seq": 16})
    sizes = dtypes(graph, "cpu")  # torch below runs CPU autocast, whose fp32 list has no softmax, norm or pow
    last: dict[str, str] = {}
    for n in graph.compute_nodes:
        if n.outputs and n.outputs[0] in sizes:
            last[n.module_path] = n.outputs[0]
    checked = 0
    for name, dtype in seen.items():
        tensor = last.get(name)
        if tensor is None or not dtype.is_floating_point:
            continue
        assert sizes[tensor] == dtype.itemsize, (name, dtype, sizes[tensor])
        checked += 1
    assert checked >= 8  # layer norms, the Conv1D projections, the LM head, embeddings, …


def test_compiled_chains_keep_their_insides(zoo: Callable[[str], Path]) -> None:
    """A compiled runtime fuses the ops between matmuls: GPT-2's GELU (seven element-wise ops in the
    export) is inside one chain, whose inner tensors are neither moved nor saved — the compiled plan
    saves less than the eager one, and its step is shorter."""
    graph = load_graph(zoo("gpt2-tiny"), {"batch": 4, "seq": 32})
    chains = fusion_chains(graph)
    inner = internal_tensors(graph, chains)
    tanh = next(n for n in graph.compute_nodes if n.op_type == "Tanh")
    assert tanh.name in chains and tanh.outputs[0] in inner
    assert sum(f.head for f in chains.values()) < len(chains) / 3  # few kernels for many ops
    mesh_profile = load_profile("h100-sxm")
    from core.mesh import DeviceMesh

    mesh = DeviceMesh.build(1, (1,), ("dp",))
    eager = CostModel(graph, mesh, mesh_profile, PRECISIONS["amp"])
    compiled = CostModel(graph, mesh, mesh_profile, PRECISIONS["amp"], runtime="compiled")
    assert compiled.saved < eager.saved


@pytest.mark.parametrize(("dtype", "runtime"), [("amp", "eager"), ("mixed", "compiled")])
def test_precision_and_runtime_are_recorded(zoo: Callable[[str], Path], dtype: str, runtime: str) -> None:
    s, _ = make_plan(PlanRequest(model=str(zoo("gpt2-tiny")), dims={"batch": 8, "seq": 32}, devices=2, dtype=dtype,
                                 runtime=runtime))
    assert s.settings.dtype == dtype and s.settings.runtime == runtime
    assert from_json(s.to_json()) == s
    # amp and mixed keep fp32 weights, gradients and AdamW states: 16 bytes a parameter.
    params = sum(t.numel for t in load_graph(zoo("gpt2-tiny"), {"batch": 8, "seq": 32}).params)
    states = sum(s.cost.memory[k] for k in ("parameters", "gradients", "optimizer"))
    assert states == pytest.approx(16 * params, rel=0.01)


@pytest.mark.slow
def test_h100_steps_from_the_microbenchmarks_alone() -> None:
    """Every measured step of bench/gpu/h100/steps.json (4 models × amp, amp compiled, FSDP2 bf16, fp32),
    priced on the profile fitted from micro.json alone: step time median |error| ≤ 7%, none over 15%;
    peak memory median |error| ≤ 10%."""
    from bench.gpu_steps import predictions

    rows = [r for r in predictions() if r["predicted_step_s"] is not None]
    errors = [abs(r["predicted_step_s"] / r["step_s"] - 1) for r in rows]
    assert len(rows) == 14
    assert statistics.median(errors) <= 0.07, errors
    assert max(errors) <= 0.15, errors
    memory = [abs(r["predicted_bytes"] / r["peak_bytes"] - 1) for r in rows]
    assert statistics.median(memory) <= 0.10, memory


@pytest.mark.parametrize(("name", "grouped"), [("gpt2-tiny", False), ("llama-gqa", True)])
def test_grouped_query_attention_is_found(zoo: Callable[[str], Path], name: str, grouped: bool) -> None:
    """`attention.grouped_kv`: k reaching the chain through repeat_kv's Expand (more elements out than
    in) — llama-gqa's 4 KV heads for 16 — and not multi-head attention's. On a GPU profile in fp32 such
    a chain is priced as SDPA's math kernel (its scores in memory), in bf16 as FlashAttention."""
    from costmodel.attention import attention_regions, grouped_kv

    g = load_graph(zoo(name), {"batch": 2, "seq": 64})
    regions = attention_regions(g).values()
    assert regions and all(grouped_kv(g, r) == grouped for r in regions)
    mem = {d: make_plan(PlanRequest(model=str(zoo(name)), dims={"batch": 2, "seq": 64}, profile="h100-sxm", devices=1,
                                    dtype=d))[0].cost.memory["activations"] for d in ("fp32", "mixed")}
    # fp32's activations are at most twice mixed's (4 bytes for 2; integers and fp32 logits alike in
    # both): 1.89 on gpt2-tiny; above that only with the math kernel's scores saved (2.22 on llama-gqa).
    ratio = mem["fp32"] / mem["mixed"]
    assert (ratio > 2.0) == grouped, ratio
