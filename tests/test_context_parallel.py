"""Context parallelism (a `cp` layout axis): the sequence split over cp, attention's keys and values
gathered there for each rank's queries (Llama-3's all-gather design) at the bytes a hand count gives,
the causal work per rank in the zig-zag order against the mask's cells, runs equal to one process,
and bad input refused in one line."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from core.collectives import Collective, Phase, Purpose
from core.context import RING, key_value_feeds
from core.layout import parse_layout
from core.mesh import DeviceMesh
from core.placement import Replicate, Shard
from costmodel.attention import attention_regions
from costmodel.comm import collective_time_s
from costmodel.context import causal_shares, zigzag_order
from costmodel.device import matmul_time_s
from hwprofiles.files import load_profile
from planner.graph import load_graph
from planner.search.plan import make_plan
from planner.search.request import PlanRequest
from planner.stagecut import strategy_chunks
from planner.strategy import Strategy


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_causal_shares_count_the_masks_cells(cp: int) -> None:
    """Each rank's share of a causal mask's cells (query i sees keys 0…i; the diagonal block's cells
    counted as they fall, the closed form takes it at half: equal as the sequence grows), zig-zag and
    contiguous; the zig-zag order's every rank the mean, 1/(2·cp)."""
    s = 256 * cp
    mask = np.tril(np.ones((s, s), dtype=bool))
    zig = [int(mask[rows].sum()) / s**2 for rows in zigzag_order(s, cp)]
    contiguous = [int(mask[r * s // cp:(r + 1) * s // cp].sum()) / s**2 for r in range(cp)]
    assert zig == pytest.approx(causal_shares(cp), abs=1 / s)
    assert contiguous == pytest.approx(causal_shares(cp, zigzag=False), abs=1 / s)
    assert causal_shares(cp) == pytest.approx([1 / (2 * cp)] * cp)
    assert sum(causal_shares(cp, zigzag=False)) == pytest.approx(0.5)
    assert sorted(i for rows in zigzag_order(s, cp) for i in rows) == list(range(s))


def test_layout_cp_splits_the_sequence(zoo: Callable[[str], Path]) -> None:
    """cp is a mesh axis after the data-parallel ones; the inputs are split on their batch over dp_shard
    and on their `seq` dim over cp; parameters are used whole on cp and stored split over dp_shard × cp."""
    lay = parse_layout("dp_shard=2,cp=2", 4)
    assert (lay.axis_names, lay.mesh_shape, lay.context_parallel, lay.data_parallel) == (("dp_shard", "cp"), (2, 2), 2, 2)
    assert str(lay) == "dp_shard=2,cp=2"
    s = _plan(zoo("llama-tiny"), "dp_shard=2,cp=2", batch=2)
    g = load_graph(zoo("llama-tiny"), s.model.dims)
    assert g.sequence_dims() == dict.fromkeys(g.inputs, 1)
    for t in g.inputs:
        assert s.tensors[t].spec.placements == (Shard(0), Shard(1))
    for p in g.params:
        if p.shape and p.shape[0] % 4 == 0:
            assert all(isinstance(x, Shard) for x in s.tensors[p.name].spec.placements), p.name  # FSDP over both


def planned_feeds(model: Path) -> tuple[Strategy, Any, dict[str, Any], frozenset[str]]:
    """llama-tiny (its 2 layers) planned at cp=4, batch 1, all-gather design: the plan, the graph, its
    attention regions and the keys' and values' feeds (`key_value_feeds`)."""
    s = _plan(model, "cp=4", batch=1)
    g = load_graph(model, s.model.dims)
    regions = attention_regions(g)
    assert len(regions) == 2
    return s, g, regions, key_value_feeds(g, [(r.nodes[0], r.nodes[-1]) for r in regions.values()])


def _plan(model: Path, layout: str, *, batch: int, devices: int = 4, seq: int = 32, method: str = "allgather",
          profile: str = "cpu", recompute: str = "none") -> Strategy:
    s, _ = make_plan(PlanRequest(model=str(model), dims={"batch": batch, "seq": seq}, profile=profile, devices=devices,
                                 recompute=recompute, dtype="fp32", layout=parse_layout(layout, devices),
                                 cp_method=method))
    return s


def test_attention_gathers_keys_and_values_over_cp(zoo: Callable[[str], Path]) -> None:
    """cp=4 on llama-tiny (batch 1, 32 tokens, 4 query heads on 2 KV heads): every activation stays split
    on cp but the keys' and values' feeds (grouped-query attention's repeat, kᵀ's transpose, the scale);
    each attention's queries keep their 8 tokens and its keys and values are gathered over cp before
    their repeat, as Llama-3 gathers its KV heads — an all_gather each of b·kv_heads·s·head_dim·4 bytes
    forward where the feeds begin, a reduce_scatter of the same backward (the feeds pass each rank's
    partial gradient back as it is), nothing on cp at the attention products."""
    s, g, regions, feeds = planned_feeds(zoo("llama-tiny"))
    cp = s.mesh.axis_names.index("cp")
    assert sorted({g.node_by_name[n].op_type for n in feeds}) == ["Expand", "Identity", "Mul", "Reshape", "Transpose",
                                                                  "Unsqueeze"]
    kv_bytes = 1 * 2 * 32 * 16 * 4
    for r in regions.values():
        assert s.tensors[r.q].spec.placements[cp] == Shard(2)  # (b, h, s, d): the queries' tokens
        for t, mm in ((r.kt, r.nodes[0]), (r.v, r.nodes[-1])):
            assert isinstance(s.tensors[t].spec.placements[cp], Replicate)
            assert not [x for x in s.reshards if x.tensor == t and x.consumer == mm]
            assert not [e for e in s.nodes[mm].collectives if e.tensor == t], s.nodes[mm].collectives
            first = t  # back through the feeds to the first, where the tensor is gathered
            while g.producer[first] in feeds:
                first = next(x for x in g.node_by_name[g.producer[first]].inputs if x in g.tensors
                             and g.tensors[x].kind.name == "ACTIVATION")
            assert g.tensors[first].shape[1] == 2 or g.tensors[first].shape[-1] == 2 * 16  # the KV heads, unrepeated
            (reader,) = [n.name for n in g.compute_nodes if first in n.inputs]
            events = [(e.kind.value, e.phase.value, e.size_bytes) for e in s.nodes[reader].collectives if e.tensor == first]
            assert events == [("all_gather", "forward", kv_bytes), ("reduce_scatter", "backward", kv_bytes)], events
    for name, node in s.nodes.items():  # no float activation whole on cp (a weight's view is the weight)
        if name in feeds or any(g.tensors[t].kind.name == "PARAM" for t in g.node_by_name[name].inputs if t in g.tensors):
            continue
        for t, spec in zip(g.node_by_name[name].outputs, node.outputs, strict=True):
            info = g.tensors[t]
            if info.is_float and info.kind.name == "ACTIVATION" and info.shape:
                assert not isinstance(spec.placements[cp], Replicate), (name, t)


def test_ring_passes_priced_against_a_hand_count(zoo: Callable[[str], Path]) -> None:
    """cp=4 under the ring design: each attention's products hold kᵀ and v split on their tokens (kernel
    RING on cp) and pass their blocks — 1·4·16·8·4 B each — cp − 1 = 3 times forward and their gradients 3
    times backward; on the CPU profile (no overlap) each pass priced as a send on the cp axis; on the
    H100 (overlapped) at what outlasts half the block's attention (4·b·h·s_q·d·s_blk FLOPs, halved causal)."""
    model = zoo("llama-tiny")
    for profile in ("cpu", "h100-sxm"):
        s = _plan(model, "cp=4", batch=1, method="ring", profile=profile)
        prof = load_profile(profile)
        mesh = DeviceMesh.build(4, (4,), ("cp",), devices_per_node=prof.devices_per_node)
        send = collective_time_s(prof, mesh, Collective.SEND_RECV, 2048.0, (0,)) + (prof.device.reshard_overhead_s or 0.0)
        block = 4.0 * 1 * 4 * 8 * 16 * 8 * 0.5
        hidden = matmul_time_s(prof.device, block, "fp32") / 2 if profile == "h100-sxm" else 0.0  # (an fp32 plan)
        g = load_graph(model, s.model.dims)
        for r in attention_regions(g).values():
            for mm, t in ((r.nodes[0], r.kt), (r.nodes[-1], r.v)):
                assert s.nodes[mm].kernels == (RING,) and s.tensors[t].spec.placements == (Shard(2 if t == r.v else 3),)
                passes = [e for e in s.nodes[mm].collectives if e.purpose is Purpose.CONTEXT_PASS]
                assert [(e.phase, e.size_bytes, e.tensor) for e in passes] == \
                    [(Phase.FORWARD, 2048.0, t)] * 3 + [(Phase.BACKWARD, 2048.0, t)] * 3
                assert [e.time_s for e in passes] == pytest.approx([max(0.0, send - hidden)] * 3
                                                                  + [max(0.0, send - 2 * hidden)] * 3)


def test_cp_method_auto_plans_the_faster(zoo: Callable[[str], Path]) -> None:
    model = zoo("llama-tiny")
    auto = _plan(model, "cp=4", batch=1, method="auto")
    assert auto.step_time_s == min(_plan(model, "cp=4", batch=1, method=m).step_time_s for m in ("allgather", "ring"))


def _run(zoo: Callable[[str], Path], layout: str, method: str, tmp_path: Path, recompute: str = "none") -> None:
    """On 4 gloo ranks, causal llama-tiny at 32 tokens (divisible by 2·cp): loss, gradients and
    parameters after a step equal one process (< 1e-5, fp32), the collectives and sends run those
    planned: k and v gathered per attention, or passed cp − 1 times each way (and forward again in
    backward where the layer is recomputed)."""
    from tests.test_training_step import run_equals_one_process

    lay = parse_layout(layout, 4)
    s = _plan(zoo("llama-tiny"), layout, batch=4 // lay.context_parallel, method=method, recompute=recompute)
    r = run_equals_one_process(s, zoo("llama-tiny"), tmp_path)
    assert r["grad_max_abs_diff"] < 1e-5 and r["loss_abs_diff"] < 1e-5
    k = s.training.micro_batches
    if method == "ring":
        again = 2 if recompute == "none" else 3
        assert r["collectives_planned"]["send_recv"] == 2 * 2 * again * (lay.context_parallel - 1) * k
    else:
        assert r["collectives_planned"]["all_gather"] >= 4 * k and "send_recv" not in r["collectives_planned"]


@pytest.mark.parametrize(("layout", "method"), [("dp_shard=2,cp=2", "allgather"), ("dp_shard=2,cp=2", "ring"),
                                               ("cp=2,tp=2", "ring")])
def test_context_parallel_run_equals_one_process(zoo: Callable[[str], Path], layout: str, method: str,
                                                 tmp_path: Path) -> None:
    _run(zoo, layout, method, tmp_path)


@pytest.mark.extended
@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_ring_recomputed_runs_its_passes_again(zoo: Callable[[str], Path], recompute: str, tmp_path: Path) -> None:
    _run(zoo, "cp=4", "ring", tmp_path, recompute=recompute)


@pytest.mark.extended
@pytest.mark.parametrize("method", ["allgather", "ring"])
def test_context_parallel_run_equals_one_process_cp4(zoo: Callable[[str], Path], method: str, tmp_path: Path) -> None:
    _run(zoo, "cp=4", method, tmp_path)


def _pipelined(model: Path, method: str) -> Strategy:
    """cp=2 × pp=2 on 4 devices, llama-tiny at 32 tokens, global batch 4 (4 micro-batches of 1)."""
    s, _ = make_plan(PlanRequest(model=str(model), dims={"seq": 32}, profile="cpu", devices=4, global_batch_size=4,
                                 recompute="none", dtype="fp32", layout=parse_layout("cp=2,pp=2", 4), cp_method=method))
    return s


def test_context_parallel_in_pipeline_stages(zoo: Callable[[str], Path]) -> None:
    """cp=2 inside each of 2 pipeline stages (the Llama-3 paper's 4D layout, in small): each stage's
    sub-mesh is the cp axis; under the ring design every attention product, in either stage, passes its
    1·4·16·16·4 B block cp − 1 = 1 time forward and once backward; under all-gather none passes, and k
    and v are gathered over cp where their feeds begin instead, in each stage (a reduce-scatter back)."""
    model = zoo("llama-tiny")
    ring, gather = _pipelined(model, "ring"), _pipelined(model, "allgather")
    assert ring.pipeline is not None and len(ring.pipeline.stages) == 2 and ring.mesh.axis_names == ("cp",)
    g = load_graph(model, ring.model.dims)
    chunk = strategy_chunks(g, ring.pipeline)
    assert {chunk[r.nodes[0]] for r in attention_regions(g).values()} == {0, 1}
    for r in attention_regions(g).values():
        for mm in r.nodes[0], r.nodes[-1]:
            passes = [e for e in ring.nodes[mm].collectives if e.purpose is Purpose.CONTEXT_PASS]
            assert ring.nodes[mm].kernels == (RING,)
            assert [(e.phase, e.size_bytes) for e in passes] == [(Phase.FORWARD, 1 * 4 * 16 * 16 * 4),
                                                                 (Phase.BACKWARD, 1 * 4 * 16 * 16 * 4)]
            assert not any(e.purpose is Purpose.CONTEXT_PASS for e in gather.nodes[mm].collectives)
            assert not gather.nodes[mm].collectives  # (k and v arrive gathered, before their repeat)
    feeds = key_value_feeds(g, [(r.nodes[0], r.nodes[-1]) for r in attention_regions(g).values()])
    gathers = [(chunk[n], e.kind.value, e.phase.value) for n in feeds for e in gather.nodes[n].collectives]
    assert sorted(gathers) == sorted([(c, "all_gather", "forward") for c in (0, 1)] * 2
                                     + [(c, "reduce_scatter", "backward") for c in (0, 1)] * 2)


@pytest.mark.extended
@pytest.mark.parametrize("method", ["allgather", "ring"])
def test_context_parallel_pipelined_run_equals_one_process(zoo: Callable[[str], Path], method: str,
                                                           tmp_path: Path) -> None:
    """cp=2 × pp=2 on 4 gloo ranks (torch.distributed.pipelining's 1F1B, each stage's chunk run on its
    cp pair) equals one process and runs the planned collectives, pipeline sends and ring passes. Under
    SGD: AdamW's first step divides each gradient by its own magnitude, and on this model's smallest
    gradients (~1e-8) turns their 2e-8 differences from summation order into 1.5e-5 in the parameters."""
    from tests.test_training_step import run_equals_one_process

    s = _pipelined(zoo("llama-tiny"), method)
    r = run_equals_one_process(s, zoo("llama-tiny"), tmp_path, optimizer="sgd")
    for st in r["stages"]:  # each stage its attention's 2 products, passed once each way, 4 micro-batches
        assert st["collectives_executed"] == st["collectives_planned"], st
        assert st["collectives_planned"].get("send_recv", 0) == (2 * 2 * 4 if method == "ring" else 0), st
    assert r["collectives_planned"]["send"] == 4


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(("model", "dims", "layout", "message"), [
    ("llama-tiny", ["batch=2", "seq=34"], "dp_shard=2,cp=2", "zig-zag chunks (2·cp, a causal mask), which does not "
                                                             "divide it"),
    ("llama-tiny", ["batch=2", "seq=30"], "cp=4", "cp=4 splits the sequence of 30 tokens into 8"),
    ("mlp", ["batch=8"], "dp_shard=2,cp=2", "no sequence dim to split"),
    ("llama-tiny", ["batch=2", "seq=32"], "dp_shard=2,ep=2,cp=2", "cp=2 with ep=2: context parallelism is planned "
                                                                  "beside dp_replicate, dp_shard, tp and pp"),
    ("llama-tiny", ["batch=4", "seq=32", "--cp-method", "ring"], "dp_shard=4",
     "--cp-method ring: context parallelism needs a cp axis"),
])
def test_bad_context_parallelism_is_one_line(zoo: Callable[[str], Path], model: str, dims: list[str], layout: str,
                                             message: str) -> None:
    r = _cli("plan", str(zoo(model)), "--devices", "4", "--profile", "cpu",
             *(x for d in dims for x in (("--dim", d) if "=" in d else (d,))), "--layout", layout, "-o", "/dev/null")
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_an_axis_named_cp_outside_a_layout_is_one_line(zoo: Callable[[str], Path]) -> None:
    """`--axis-names cp` without a layout would be an axis the search splits freely while the cost model
    and the executor price and run it as context parallelism's (its keys' and values' gradients taken as
    partial there): refused in one line."""
    r = _cli("plan", str(zoo("llama-tiny")), "--devices", "2", "--profile", "cpu", "--dim", "batch=2", "--dim",
             "seq=32", "--mesh", "2", "--axis-names", "cp", "-o", "/dev/null")
    assert r.returncode == 2 and "'cp' is context parallelism's axis, planned from a layout" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_long_sequences_add_an_fsdp_cp_hand_layout() -> None:
    """The planner's hand layouts add FSDP + CP (the sequence split over a node) from LONG_CONTEXT tokens."""
    from planner.search.incumbents import LONG_CONTEXT, hand_layouts

    names = {h.name: h.layout for h in hand_layouts(64, 8, 131072)}
    assert names["FSDP + CP"] == "dp_shard=8,cp=8" and parse_layout(names["FSDP + CP"], 64).context_parallel == 8
    assert "FSDP + CP" not in {h.name for h in hand_layouts(64, 8, LONG_CONTEXT - 1)}
    assert "FSDP + CP" not in {h.name for h in hand_layouts(64, 8, None)}
    assert {h.name: h.layout for h in hand_layouts(8, 8, 131072)}["FSDP + CP"] == "cp=8"


def test_a_shared_cost_model_tells_cp_from_another_axis(zoo: Callable[[str], Path]) -> None:
    """Within one planning call (`sharing`), a mesh of the same shape under other names (dp × tp, then
    dp_shard × cp) gets its own cost model: the ring's passes are priced on the cp mesh."""
    from planner.search.build import sharing

    model = zoo("llama-tiny")
    with sharing():
        make_plan(PlanRequest(model=str(model), dims={"batch": 2, "seq": 32}, profile="cpu", devices=4,
                              mesh_shape=(2, 2), axis_names=("dp", "tp"), recompute="none", dtype="fp32"))
        s = _plan(model, "dp_shard=2,cp=2", batch=2, method="ring")
    assert sum(e.purpose is Purpose.CONTEXT_PASS for n in s.nodes.values() for e in n.collectives) == 2 * 2 * 2


@pytest.mark.parametrize("method", ["allgather", "ring"])
def test_explain_names_the_design_and_its_traffic(zoo: Callable[[str], Path], method: str, tmp_path: Path) -> None:
    """explain's context section: cp's degree, the design, and the traffic on cp a step per rank — the
    ring's 24 passes of 2048 B (cp=4: 2 attentions × 2 products × 3 passes × 2 directions), or the
    collectives on cp among them the 8 gathers and scatters of kᵀ and v."""
    from planner.explain import explain_strategy

    s = _plan(zoo("llama-tiny"), "cp=4", batch=1, method=method)
    s.save(tmp_path / "s.json")
    c = explain_strategy(str(tmp_path / "s.json"))["context"]
    assert (c["context_parallel"], c["design"]) == (4, method)
    if method == "ring":
        assert (c["count"], c["bytes"]) == (24, 24 * 2048.0)
    else:
        kv = [e for n in s.nodes.values() for e in n.collectives if e.size_bytes == 1 * 2 * 16 * 32 * 4]
        assert c["count"] >= len(kv) >= 8
