"""ZeRO-1/2 as the planner decides it and the executor runs it: per parameter (the ILP's choice under
`--zero auto`), over several mesh axes at once, and fused by MindSpore's comm_fusion kinds
(reduce-scatter units, all-gather groups)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from core.collectives import Cadence, Collective, Purpose
from core.errors import MeshplanError
from core.mesh import DeviceMesh
from core.placement import OpStrategy, Spec
from costmodel.buckets import CommFusion, gather_groups, pack_buckets, zero_units
from costmodel.comm import collective_time_s
from costmodel.memory import PRECISIONS, model_state_bytes
from costmodel.step import CostModel
from executor.preflight import planned_counts
from hwprofiles.files import load_profile
from planner.graph import load_graph
from planner.rules import strategies_for
from planner.search.plan import make_plan
from planner.search.request import PlanRequest
from tests.test_training_step import run_equals_one_process

H100 = load_profile("h100-sxm")
BF16 = PRECISIONS["bf16"]


def _batch_split_everywhere(g, mesh: DeviceMesh) -> dict[str, OpStrategy]:
    """Every node with its batch split over all mesh axes, everything else replicated."""
    want = "S(0)" if mesh.ndim == 1 else ",".join(["S(0)"] * mesh.ndim)

    def dp(s: OpStrategy) -> bool:
        return str(s.input_specs[0]) == want and all(sp is None or sp.is_replicated for sp in s.input_specs[1:])

    return {n.name: next(filter(dp, strategies_for(n, g, mesh).strategies)) for n in g.compute_nodes}


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_over_two_axes_closed_form(stage: int, zoo: Callable[[str], Path]) -> None:
    # Data parallelism over a 2×4 mesh (both axes split the batch): ZeRO shards each parameter's states
    # over all 8 ranks (the ZeRO paper's forms with N_d = 8), reduce-scattering over axis 0 (2Ψ bytes),
    # then what is left over axis 1 (2Ψ/2 bytes); after the optimizer step the shard is gathered over
    # axis 1 (to 2Ψ/2 bytes), then axis 0 (to 2Ψ). One unit (Ψ fits 25 MiB): one collective per axis.
    g = load_graph(zoo("mlp"), {"batch": 64})
    mesh = DeviceMesh.build(8, (2, 4), devices_per_node=8)
    cost = CostModel(g, mesh, H100, BF16, zero_stage=stage).price(_batch_split_everywhere(g, mesh))
    psi = g.num_params
    states = cost.memory["parameters"] + cost.memory["gradients"] + cost.memory["optimizer"]
    assert states == pytest.approx(model_state_bytes(psi, BF16, zero_stage=stage, dp_degree=8))
    assert cost.priced.zero_stages == {p.name: stage for p in g.params}
    rs = {a: sum(e.size_bytes for e in cost.events if e.kind is Collective.REDUCE_SCATTER and e.axes == (a,))
          for a in (0, 1)}
    ag = {a: sum(e.size_bytes for e in cost.events if e.kind is Collective.ALL_GATHER and e.axes == (a,)) for a in (0, 1)}
    assert rs == {0: 2 * psi, 1: 2 * psi / 2} and ag == {0: 2 * psi, 1: 2 * psi / 2}
    assert Collective.ALL_REDUCE not in {e.kind for e in cost.events}
    want = sum(collective_time_s(H100, mesh, kind, size, (a,))
               for kind, sizes in ((Collective.REDUCE_SCATTER, rs), (Collective.ALL_GATHER, ag)) for a, size in sizes.items())
    assert sum(e.time_s for e in cost.events) == pytest.approx(want)  # one micro-batch: stage 2 scatters once too


def test_zero_edge_priced_as_its_stage(zoo: Callable[[str], Path]) -> None:
    # The ILP prices a parameter edge at the stage of its choice: at stage 1 the reduce-scatter and the
    # gather instead of the all-reduce, at stage 2 the reduce-scatter once per micro-batch (k = 4). Each,
    # priced alone, pays its bandwidth term and its bytes' share of one bucket's latency (a bucket holds
    # every gradient of the mlp: 2Ψ bytes), as the all-reduce does.
    g = load_graph(zoo("mlp"), {"batch": 16})
    mesh = DeviceMesh.build(4, devices_per_node=8)
    cm = CostModel(g, mesh, H100, BF16, micro_batches=4)
    w, r, split = "fc1.weight", Spec.replicated(1), frozenset({0})
    grad, weights = g.tensors[w].numel * BF16.grad_bytes, g.tensors[w].numel * BF16.weight_bytes
    fill = g.num_params * BF16.grad_bytes

    def alone(kind: Collective, size: float) -> float:
        t = [collective_time_s(H100, mesh, kind, b, (0,)) for b in (1.0, 2.0, size)]
        return t[2] - (2 * t[0] - t[1]) * (1 - size / fill)

    assert cm.edge_time_s(w, r, r, split) == pytest.approx(alone(Collective.ALL_REDUCE, grad))
    rs_s, ag_s = alone(Collective.REDUCE_SCATTER, grad), alone(Collective.ALL_GATHER, weights)
    assert cm.edge_time_s(w, r, r, split, zero_stage=1) == pytest.approx(rs_s + ag_s)
    assert cm.edge_time_s(w, r, r, split, zero_stage=2) == pytest.approx(4 * rs_s + ag_s)
    # A parameter below the threshold is never sharded, whatever its stage.
    small = CostModel(g, mesh, H100, BF16, micro_batches=4, zero_threshold_bytes=weights + 1)
    assert small.edge_time_s(w, r, r, split, zero_stage=2) == pytest.approx(alone(Collective.ALL_REDUCE, grad))


def _data_parallel_pins(g) -> dict[str, str]:
    return {g.inputs[0]: "S(0)", **{p.name: "R" for p in g.params}}


def test_zero_auto_chooses_per_parameter_under_memory(zoo: Callable[[str], Path]) -> None:
    # --zero auto (the default), data parallelism on 2 gloo ranks (the cpu profile: a reduce-scatter and
    # a gather cost more than one all-reduce): without memory pressure every parameter keeps stage 0;
    # with a limit that stage 0 does not meet but ZeRO-1 on every parameter does, the ILP shards the
    # optimizer states of some parameters, not all, and the plan fits.
    model = zoo("gpt2-tiny")
    g = load_graph(model, {"batch": 32, "seq": 32})
    base = dict(model=str(model), dims={"batch": 32, "seq": 32}, profile="cpu", devices=2, mesh_shape=(2,),
                mode="semi", pins=_data_parallel_pins(g))
    free, _ = make_plan(PlanRequest(**base))
    assert free.training.zero_stages == {} and free.training.zero_stage == 0
    one, _ = make_plan(PlanRequest(**base, zero_stage=1))
    assert len(one.training.zero_stages) > len(g.params) / 2
    m0, m1 = free.cost.memory_bytes_per_device, one.cost.memory_bytes_per_device
    assert m1 < m0
    limit = (m0 + m1) / 2
    auto, _ = make_plan(PlanRequest(**base, memory_limit_gib=limit / 2**30))
    assert auto.cost.memory_bytes_per_device <= limit
    assert 0 < len(auto.training.zero_stages) < len(g.params)
    assert free.cost.step_time_s <= auto.cost.step_time_s


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_over_two_axes_runs_as_planned(stage: int, zoo: Callable[[str], Path], tmp_path: Path) -> None:
    # ZeRO over both axes of a 2×2 mesh (the gradient reduced over both): the executor reduce-scatters
    # over axis 0 then axis 1 and gathers back in reverse; equal to one process, collectives as planned.
    model = zoo("mlp")
    s, _ = make_plan(PlanRequest(model=str(model), profile="cpu", devices=4, mesh_shape=(2, 2), mode="data-parallel",
                                 global_batch_size=64, accumulation_steps=2, zero_stage=stage))
    assert set(s.training.zero_stages.values()) == {stage}
    r = run_equals_one_process(s, model, tmp_path, "sgd")
    assert r["collectives_planned"]["reduce_scatter"] == 2 * (2 if stage == 2 else 1)


@pytest.mark.slow
def test_zero_auto_mixed_stages_run_as_planned(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    # The ILP's per-parameter stages (some parameters at ZeRO-1, the rest all-reduced) run as planned.
    model = zoo("gpt2-tiny")
    g = load_graph(model, {"batch": 32, "seq": 32})
    base = dict(model=str(model), dims={"batch": 32, "seq": 32}, profile="cpu", devices=2, mesh_shape=(2,),
                mode="semi", pins=_data_parallel_pins(g))
    m0 = make_plan(PlanRequest(**base, zero_stage=0))[0].cost.memory_bytes_per_device
    m2 = make_plan(PlanRequest(**base, zero_stage=2))[0].cost.memory_bytes_per_device
    s, _ = make_plan(PlanRequest(**base, memory_limit_gib=(m0 + m2) / 2 / 2**30))
    assert 0 < len(s.training.zero_stages) < len(g.params)
    r = run_equals_one_process(s, model, tmp_path)
    assert {"all_reduce", "reduce_scatter", "all_gather"} <= set(r["collectives_planned"])


def test_comm_fusion_kinds_closed_form(zoo: Callable[[str], Path]) -> None:
    # MindSpore's comm_fusion per kind: ZeRO-1 units packed by the reduce-scatter cap (16 KiB: the mlp's
    # bf16 gradients, 2·Ψ bytes, need several), their gathers grouped up to the all-gather cap (1 MiB:
    # one group); the step pays one reduce-scatter per unit and one gather for them all.
    g = load_graph(zoo("mlp"), {"batch": 32})
    mesh = DeviceMesh.build(4, devices_per_node=8)
    fusion = CommFusion(allreduce=25 * 2**20, reducescatter=16 * 2**10, allgather=2**20)
    cost = CostModel(g, mesh, H100, BF16, zero_stage=1, fusion=fusion).price(_batch_split_everywhere(g, mesh))
    grads = {p.name: ((0,), p.numel * 2.0) for p in g.params}
    units = zero_units(grads, dict.fromkeys(grads, 1), fusion)
    assert len(units) == len(pack_buckets(grads, 16 * 2**10)) > 1
    assert gather_groups(units, {n: b for n, (_, b) in grads.items()}, fusion.allgather) == [list(range(len(units)))]
    rs = sum(collective_time_s(H100, mesh, Collective.REDUCE_SCATTER, sum(grads[n][1] for n in u.names), (0,))
             for u in units)
    ag = collective_time_s(H100, mesh, Collective.ALL_GATHER, 2.0 * g.num_params, (0,))
    assert sum(e.time_s for e in cost.events if e.kind is Collective.REDUCE_SCATTER) == pytest.approx(rs)
    assert sum(e.time_s for e in cost.events if e.kind is Collective.ALL_GATHER) == pytest.approx(ag)
    assert all(e.cadence is Cadence.STEP for e in cost.events if e.purpose is Purpose.GRAD_REDUCE_SCATTER)


def test_comm_fusion_auto_is_never_slower(zoo: Callable[[str], Path]) -> None:
    # --comm-fusion auto prices the plan found at each candidate cap per kind and keeps the fastest: on
    # the serial composer (every collective exposed) that is one bucket per kind for the mlp's
    # gradients, faster than 1 KiB buckets (one latency per parameter and kind).
    model = zoo("mlp")
    base = dict(model=str(model), dims={"batch": 64}, profile="cpu", devices=2, mesh_shape=(2,),
                mode="data-parallel", zero_stage=1)
    small, _ = make_plan(PlanRequest(**base, fusion=CommFusion.uniform(2**10)))
    auto, _ = make_plan(PlanRequest(**base, fusion=None))
    assert small.tensors == auto.tensors  # the same plan, packed differently
    assert auto.cost.step_time_s < small.cost.step_time_s
    counts = {k: sum(1 for n in auto.nodes.values() for c in n.collectives if c.kind.value == k)
              for k in ("reduce_scatter", "all_gather")}
    assert counts == {"reduce_scatter": 4, "all_gather": 4}  # one event per parameter ...
    assert auto.training.comm_fusion.reducescatter >= 2**20 and auto.training.comm_fusion.allgather >= 2**20
    assert planned_counts(auto) == {"reduce_scatter": 1, "all_gather": 1}  # ... in one bucket each


@pytest.mark.slow
def test_comm_fusion_kinds_run_as_planned(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    # Several ZeRO-1 units gathered in one all-gather: the executor packs and gathers as planned.
    model = zoo("mlp")
    fusion = CommFusion(allreduce=25 * 2**20, reducescatter=16 * 2**10, allgather=2**20)
    s, _ = make_plan(PlanRequest(model=str(model), dims={"batch": 64}, profile="cpu", devices=2, mesh_shape=(2,),
                                 mode="data-parallel", zero_stage=1, fusion=fusion))
    r = run_equals_one_process(s, model, tmp_path)
    assert r["collectives_planned"]["reduce_scatter"] > 1 and r["collectives_planned"]["all_gather"] == 1


def test_zero_shard_group_smaller_than_data_parallel(zoo: Callable[[str], Path]) -> None:
    # MindSpore's optimizer_weight_shard_size = 4 on a 2×4 data-parallel mesh: ZeRO-1 shards the states
    # over the inner axis (4 ranks: 12Ψ/4 bytes of them), reduce-scatters over it (2Ψ bytes), all-reduces
    # the shard over the outer axis (2Ψ/4), and gathers the updated shard over the inner axis (2Ψ).
    g = load_graph(zoo("mlp"), {"batch": 64})
    mesh = DeviceMesh.build(8, (2, 4), devices_per_node=8)
    cost = CostModel(g, mesh, H100, BF16, zero_stage=1, zero_shard_size=4).price(_batch_split_everywhere(g, mesh))
    psi = g.num_params
    assert cost.memory["optimizer"] == pytest.approx(12 * psi / 4)
    volume = {(e.kind, e.axes): 0.0 for e in cost.events}
    for e in cost.events:
        volume[e.kind, e.axes] += e.size_bytes
    assert volume == {(Collective.REDUCE_SCATTER, (1,)): 2 * psi, (Collective.ALL_REDUCE, (0,)): 2 * psi / 4,
                      (Collective.ALL_GATHER, (1,)): 2 * psi}
    with pytest.raises(MeshplanError, match=r"`zero_shard_size` 3: .* pick a shard size among 4, 8"):
        CostModel(g, mesh, H100, BF16, zero_stage=1, zero_shard_size=3).price(_batch_split_everywhere(g, mesh))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_shard_group_runs_as_planned(stage: int, zoo: Callable[[str], Path], tmp_path: Path) -> None:
    # The same on 4 gloo ranks (2×2, shard groups of 2): equal to one process, collectives as planned.
    model = zoo("mlp")
    s, _ = make_plan(PlanRequest(model=str(model), profile="cpu", devices=4, mesh_shape=(2, 2), mode="data-parallel",
                                 global_batch_size=64, accumulation_steps=2, zero_stage=stage, zero_shard_size=2))
    assert s.training.zero_shard_size == 2
    r = run_equals_one_process(s, model, tmp_path, "sgd")
    per = 2 if stage == 2 else 1
    assert r["collectives_planned"] == {"reduce_scatter": per, "all_reduce": per, "all_gather": 1}


@pytest.mark.parametrize(("layout", "zero"), [("dp_replicate=8", 0), ("dp_replicate=8", 1), ("dp_shard=8", 3),
                                            ("dp_replicate=2,dp_shard=4", 3)])
def test_hand_layout_states_are_the_zero_papers(layout: str, zero: int, zoo: Callable[[str], Path]) -> None:
    # A hand layout priced as written: DDP holds every parameter whole (no op may split a weight over
    # dp_replicate), ZeRO-1 shards every optimizer state over the 8 ranks, FSDP (dp_shard, ZeRO-3)
    # every weight, gradient and state. Per parameter, bf16 (Rajbhandari et al. §5, N_d = 8): weights
    # 2Ψ, gradients 2Ψ, optimizer 12Ψ; 12Ψ/8 at ZeRO-1; all /8 at ZeRO-3. The one exception at ZeRO-1
    # is the position table, whose gradient the plan reduces on its (replicated) lookup's output, of
    # the same size, not on the table itself: nothing there for ZeRO to shard. HSDP (2 replicas of
    # FSDP over 4) at ZeRO-3: N_d = 4, every parameter whole over dp_replicate.
    model = zoo("gpt2-medium")
    dims = {"batch": 64, "seq": 1024}
    s, _ = make_plan(PlanRequest(model=str(model), dims=dims, profile="h100-sxm", devices=8, layout=layout,
                                 zero_stage=zero, recompute="none", dtype="bf16"))  # the paper's (not the GPU default)
    g = load_graph(model, dims)
    psi = g.num_params
    whole = [p for p in g.params if p.name not in s.training.zero_stages]
    if zero == 1:
        assert [p.name for p in whole] == ["model.transformer.wpe.weight"]
        assert set(s.training.zero_stages.values()) == {1}
    shards = 4 if layout.startswith("dp_replicate=2") else 8
    state = {0: (2, 2, 12), 1: (2, 2, 12 / 8), 3: (2 / shards, 2 / shards, 12 / shards)}[zero]
    kept = sum(p.numel for p in whole) if zero == 1 else 0  # at stage 0: its 12 bytes whole
    want = dict(zip(("parameters", "gradients", "optimizer"), (b * psi for b in state), strict=True))
    want["optimizer"] += kept * (12 - 12 / 8)
    assert {k: s.cost.memory[k] for k in want} == pytest.approx(want, rel=1e-12)
    assert all(s.spec_of(p.name).num_shards(0, s.mesh.shape) == (shards if zero == 3 else 1) for p in g.params)
    replicas = [a for a, n in enumerate(s.mesh.axis_names) if n == "dp_replicate"]
    assert all(str(s.spec_of(p.name).placements[a]) == "R" for p in g.params for a in replicas)


def test_hsdp_gradient_is_scattered_before_it_is_reduced(zoo: Callable[[str], Path]) -> None:
    # HSDP (2 replicas of FSDP over 4): each split parameter's gradient is reduce-scattered over dp_shard
    # (its whole bf16 size in) and only the quarter left is all-reduced over dp_replicate, FSDP2's order;
    # an all-reduce of the whole gradient across replicas (DTensor's axis order) would move 4× the bytes.
    model = zoo("gpt2-medium")
    dims = {"batch": 64, "seq": 1024}
    s, _ = make_plan(PlanRequest(model=str(model), dims=dims, profile="h100-sxm", devices=8,
                                 layout="dp_replicate=2,dp_shard=4", zero_stage=3, recompute="none", dtype="bf16"))
    g = load_graph(model, dims)
    rep, shard = s.mesh.axis_names.index("dp_replicate"), s.mesh.axis_names.index("dp_shard")
    grads = [c for n in s.nodes.values() for c in n.collectives
             if c.purpose in (Purpose.GRAD_SYNC, Purpose.GRAD_REDUCE_SCATTER)]
    checked = 0
    for p in g.params:
        mine = [c for c in grads if c.tensor == p.name]
        if not mine:
            continue  # reduced on an activation (the position table's lookup)
        rs = [c for c in mine if c.kind is Collective.REDUCE_SCATTER]
        ar = [c for c in mine if c.kind is Collective.ALL_REDUCE]
        assert [c.axes for c in rs] == [(shard,)] and [c.axes for c in ar] == [(rep,)], p.name
        assert rs[0].size_bytes == p.numel * BF16.grad_bytes
        assert ar[0].size_bytes == p.numel * BF16.grad_bytes / 4
        checked += 1
    assert checked >= len(g.params) - 1


def _scatter_first_worker(rank: int, port: int, out) -> None:  # type: ignore[no-untyped-def]
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.utils._python_dispatch import TorchDispatchMode

    from executor.dtensors import redistribute, scatter_first

    class Sizes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[str, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if any(t is DTensor for t in types):
                return NotImplemented
            name = func._overloadpacket.__name__
            if name in ("all_reduce", "reduce_scatter_tensor"):
                self.seen.append((name, args[0].numel()))
            return func(*args, **(kwargs or {}))

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        stored = [Replicate(), Shard(0)]
        results = []
        for ordered in (False, True):
            torch.manual_seed(0)
            whole = torch.randn(8, 6)
            local = whole.chunk(2)[mesh.get_local_rank(1)].clone().requires_grad_(True)
            w = DTensor.from_local(local, mesh, stored, shape=whole.shape, stride=whole.stride(), grad_placements=stored)
            grad = [Partial(), Partial()]
            used = redistribute(w, [Replicate(), Replicate()])
            used = scatter_first(used, stored, grad) if ordered else used
            sizes = Sizes()
            with sizes:
                (used.to_local(grad_placements=grad) * (rank + 1)).sum().backward()
            results.append((sizes.seen, local.grad.clone()))
        if rank == 0:
            out.put(("done", results[0][0], results[1][0], bool(torch.equal(results[0][1], results[1][1])),
                     results[1][1].tolist()))
        dist.barrier()
        dist.destroy_process_group()
    except Exception as e:
        out.put(("error", rank, f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from e


def test_executor_scatters_a_split_parameters_gradient_first() -> None:
    # The executor's order for the same: on a 2×2 mesh (4 gloo ranks), a parameter stored whole over
    # dp_replicate and split over dp_shard, gathered for use, its gradient partial on both axes.
    # DTensor alone all-reduces the whole 8×6 gradient then scatters it; ordered, the reduce-scatter
    # takes the whole and the all-reduce a 4×6 shard — and the gradient is the same (Σ rank + 1 = 10).
    from executor.ranks import run_ranks

    got: list[tuple] = []

    def handle(msg: tuple) -> bool:
        got.append(msg)
        return True

    run_ranks(_scatter_first_worker, 4, lambda r, port, q: (r, port, q), handle, timeout_s=120,
              error=MeshplanError, what="scatter_first")
    _, plain, ordered, same, grad = got[0]
    assert plain == [("all_reduce", 48), ("reduce_scatter_tensor", 48)]
    assert ordered == [("reduce_scatter_tensor", 48), ("all_reduce", 24)]
    assert same and grad == [[10.0] * 6] * 4
