"""The cost model against closed forms: Megatron FLOPs and TP volume, ring all-reduce, DP gradient
volume, ZeRO memory."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from core.collectives import Cadence, Collective, LinkLevel, Phase
from core.graph import OpGraph, OpNode
from core.mesh import DeviceMesh
from core.placement import OpStrategy, Shard, Spec, parse_spec
from costmodel.attention import attention_regions, materialized_kernels
from costmodel.buckets import CommFusion, pack_buckets
from costmodel.comm import collective_time_s
from costmodel.compute import ComputeCost
from costmodel.device import link_collective_time_s, matmul_time_s
from costmodel.memory import PRECISIONS, model_state_bytes
from costmodel.step import CostModel, Purpose
from hwprofiles.files import load_profile
from planner.graph import graph_from_proto, load_graph
from planner.rules import OpContext, replicated_strategy, strategies_for

H100 = load_profile("h100-sxm")
BF16 = PRECISIONS["bf16"]


def pick(graph: OpGraph, mesh: DeviceMesh, node: str, want: str) -> OpStrategy:
    """The strategy of `node` whose printed form is `want` (e.g. "[R] [S(1)] → [S(1)]")."""
    options = strategies_for(graph.node_by_name[node], graph, mesh).strategies
    for s in options:
        if s.name == want:
            return s
    raise AssertionError(f"{node}: no strategy {want}; have {[s.name for s in options]}")


def replicated_plan(graph: OpGraph, mesh: DeviceMesh) -> dict[str, OpStrategy]:
    return {n.name: replicated_strategy(OpContext.of(n, graph), mesh.ndim) for n in graph.compute_nodes}


def test_megatron_training_flops(zoo: Callable[[str], Path]) -> None:
    # Korthikanti et al. 2022, appendix A: per step (forward + backward = 3× forward), no recomputation,
    # 72·B·s·L·h²·(1 + s/(6h)) for the layers — 24·B·s·h² forward for the four h×h-equivalent matmuls
    # (QKV 3h², projection h², MLP 8h² → 12h² params, 2 FLOPs each) plus 4·B·s²·h for scores and
    # context — and 3·2·B·s·h·V for the logits.
    b, s = 2, 1024
    g = load_graph(zoo("gpt2-medium"), {"batch": b, "seq": s})
    h, n_layer, v = 1024, 24, 50257
    mesh = DeviceMesh.build(1)
    cost = CostModel(g, mesh, H100, BF16).price(replicated_plan(g, mesh))
    expected = 72 * b * s * n_layer * h * h * (1 + s / (6 * h)) + 6 * b * s * h * v
    assert cost.flops_matmul == pytest.approx(expected, rel=0.02)
    assert cost.comm_s == 0.0


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_all_reduce_on_a_mesh_axis(n: int) -> None:
    # Inside one node: 2(n−1)·α + 2(n−1)/n·S/β with α = 1 µs, β = 370 GB/s (the H100 preset).
    mesh = DeviceMesh.build(n, devices_per_node=8)
    size = 256e6
    t = collective_time_s(H100, mesh, Collective.ALL_REDUCE, size, (0,))
    assert t == pytest.approx(2 * (n - 1) * 1e-6 + 2 * (n - 1) / n * size / 370e9)


def test_hierarchical_all_reduce_across_nodes() -> None:
    # 2 nodes × 8: reduce-scatter inside (8), all-reduce across (2) on S/8, all-gather inside (8).
    mesh = DeviceMesh.build(16, (2, 8), devices_per_node=8)
    size = 1e9
    t = collective_time_s(H100, mesh, Collective.ALL_REDUCE, size, (0, 1))
    rs = 7 * 1e-6 + 7 / 8 * size / 370e9
    ar = 2 * 1 * 5e-6 + 2 * 1 / 2 * (size / 8) / 46e9
    assert t == pytest.approx(rs + ar + rs)
    assert mesh.level((0,)) is LinkLevel.INTER_NODE and mesh.level((1,)) is LinkLevel.INTRA_NODE


def _megatron_layer(bs: int, h: int) -> onnx.ModelProto:
    """X0 · scale → two (col-parallel MatMul → Relu → row-parallel MatMul → + residual) blocks,
    standing in for a transformer layer's attention and MLP halves."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(np.ones(h, np.float32), "scale")]
    nodes = [helper.make_node("Mul", ["x0", "scale"], ["x"], name="embed")]
    prev = "x"
    for blk in range(2):
        w1, w2 = f"w1_{blk}", f"w2_{blk}"
        inits += [numpy_helper.from_array(rng.standard_normal((h, 4 * h)).astype(np.float32), w1),
                  numpy_helper.from_array(rng.standard_normal((4 * h, h)).astype(np.float32), w2)]
        nodes += [helper.make_node("MatMul", [prev, w1], [f"a{blk}"], name=f"col{blk}"),
                  helper.make_node("Relu", [f"a{blk}"], [f"r{blk}"], name=f"relu{blk}"),
                  helper.make_node("MatMul", [f"r{blk}", w2], [f"b{blk}"], name=f"row{blk}"),
                  helper.make_node("Add", [f"b{blk}", prev], [f"y{blk}"], name=f"res{blk}")]
        prev = f"y{blk}"
    graph = helper.make_graph(nodes, "layer", [helper.make_tensor_value_info("x0", TensorProto.FLOAT, [bs, h])],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT, None)], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


@pytest.mark.parametrize("t", [2, 4, 8])
def test_megatron_tensor_parallel_volume(t: int) -> None:
    # Megatron-LM SC'21 §3.2: per layer and step, 2 all-reduces forward (after each row-parallel
    # matmul) and 2 backward (the input gradient of each column-parallel matmul), each of B·s·h
    # elements; nothing else moves.
    bs, h = 64, 256
    g = graph_from_proto(_megatron_layer(bs, h), {})
    mesh = DeviceMesh.build(t, axis_names=("tp",), devices_per_node=8)
    plan = replicated_plan(g, mesh)
    for blk in range(2):
        plan[f"col{blk}"] = pick(g, mesh, f"col{blk}", "[R] [S(1)] → [S(1)]")
        plan[f"relu{blk}"] = pick(g, mesh, f"relu{blk}", "[S(1)] → [S(1)]")
        plan[f"row{blk}"] = pick(g, mesh, f"row{blk}", "[S(1)] [S(0)] → [P]")
    cost = CostModel(g, mesh, H100, BF16).price(plan)
    kinds = sorted((e.kind.value, e.phase is Phase.BACKWARD, e.size_bytes) for e in cost.events)
    msg = bs * h * BF16.activation_bytes
    assert kinds == [("all_reduce", False, msg)] * 2 + [("all_reduce", True, msg)] * 2
    per = 2 * (t - 1) * 1e-6 + 2 * (t - 1) / t * msg / 370e9
    assert cost.comm_s == pytest.approx(4 * per)
    # Each device sends 4 · 2(t−1)/t · B·s·h = 8·B·s·h·(t−1)/t elements over the four ring
    # all-reduces (REFERENCES.md's figure, in elements), i.e. twice that in bytes at 2 bytes each.
    sent_bytes = sum(2 * (t - 1) / t * e.size_bytes for e in cost.events)
    assert sent_bytes == pytest.approx(8 * bs * h * (t - 1) / t * BF16.activation_bytes)


def test_data_parallel_gradient_volume(zoo: Callable[[str], Path]) -> None:
    # Pure DP on 4 devices: every parameter's gradient (Ψ elements) is all-reduced once per step.
    g = load_graph(zoo("mlp"), {"batch": 32})
    mesh = DeviceMesh.build(4)
    def data_parallel(s: OpStrategy) -> bool:  # batch split, everything else replicated
        return str(s.input_specs[0]) == "S(0)" and all(sp is None or str(sp) == "R" for sp in s.input_specs[1:])

    plan = {n.name: next(filter(data_parallel, strategies_for(n, g, mesh).strategies)) for n in g.compute_nodes}
    cost = CostModel(g, mesh, H100, BF16).price(plan)
    syncs = [e for e in cost.events if e.purpose is Purpose.GRAD_SYNC]
    assert all(e.kind is Collective.ALL_REDUCE and e.axes == (0,) and e.phase is Phase.BACKWARD and e.cadence is Cadence.STEP for e in syncs)
    assert sum(e.size_bytes for e in syncs) == g.num_params * BF16.grad_bytes
    assert len(cost.events) == len(syncs)
    # Model states replicated: (2 + 2 + 12) bytes per parameter on every device.
    states = cost.memory["parameters"] + cost.memory["gradients"] + cost.memory["optimizer"]
    assert states == pytest.approx(16 * g.num_params)


def test_optimizer_state_memory_closed_forms() -> None:
    # ZeRO paper §5, mixed-precision Adam, K = 12: baseline (2+2+K)Ψ; stage 1 4Ψ + KΨ/N_d;
    # stage 2 2Ψ + (2+K)Ψ/N_d; stage 3 (4+K)Ψ/N_d. fp32 training: 4 + 4 + 8 bytes per parameter.
    psi, nd = 7.5e9, 64
    assert BF16.optimizer_bytes == 12
    assert model_state_bytes(psi, BF16) == 16 * psi
    assert model_state_bytes(psi, BF16, zero_stage=1, dp_degree=nd) == pytest.approx(4 * psi + 12 * psi / nd)
    assert model_state_bytes(psi, BF16, zero_stage=2, dp_degree=nd) == pytest.approx(2 * psi + 14 * psi / nd)
    assert model_state_bytes(psi, BF16, zero_stage=3, dp_degree=nd) == pytest.approx(16 * psi / nd)
    assert PRECISIONS["fp32"].model_state_bytes == 16
    # The ZeRO paper's example: Ψ = 7.5B, N_d = 64 → 120 GB, 31.4 GB, 16.6 GB, 1.88 GB.
    assert [round(model_state_bytes(psi, BF16, zero_stage=z, dp_degree=nd) / 1e9, 1) for z in range(4)] == \
        [120.0, 31.4, 16.6, 1.9]


def test_sharded_plan_divides_compute(zoo: Callable[[str], Path]) -> None:
    # Splitting the batch 4 ways divides each matmul's FLOPs by 4.
    g = load_graph(zoo("mlp"), {"batch": 4096})
    one, four = DeviceMesh.build(1), DeviceMesh.build(4)
    flops1 = CostModel(g, one, H100, BF16).price(replicated_plan(g, one)).flops_matmul
    plan = {n.name: next(s for s in strategies_for(n, g, four).strategies if str(s.input_specs[0]) == "S(0)")
            for n in g.compute_nodes}
    assert CostModel(g, four, H100, BF16).price(plan).flops_matmul == pytest.approx(flops1 / 4)


def test_sharded_parameters_gathered_then_reduce_scattered(zoo: Callable[[str], Path]) -> None:
    # FSDP / ZeRO-3 (Rajbhandari et al. SC'20): parameters stored split over the data-parallel axis,
    # gathered for forward, gathered again for backward, their gradients reduce-scattered — three
    # collectives of Ψ where data parallelism's all-reduce is two: 1.5× the volume. Gathered again
    # only where backward reads them, as autograd saves them and the executor regathers: a weight
    # whose input needs a gradient (dX = dY·Wᵀ), not the first layer's (its input is the data: torch
    # saves only x, for dW = xᵀ·dY), not the Gemm's biases (db = Σ dY).
    g = load_graph(zoo("mlp"), {"batch": 32})
    mesh = DeviceMesh.build(4)

    def data_parallel(s: OpStrategy) -> bool:
        return str(s.input_specs[0]) == "S(0)" and all(sp is None or str(sp) == "R" for sp in s.input_specs[1:])

    plan = {n.name: next(filter(data_parallel, strategies_for(n, g, mesh).strategies)) for n in g.compute_nodes}
    stored = {p.name: Spec((Shard(0),)) for p in g.params}
    cost = CostModel(g, mesh, H100, BF16).price(plan, stored)
    fwd = [e for e in cost.events if e.phase is Phase.FORWARD]
    bwd = [e for e in cost.events if e.phase is Phase.BACKWARD]
    assert {e.kind for e in fwd} == {Collective.ALL_GATHER}
    assert {e.kind for e in bwd} == {Collective.ALL_GATHER, Collective.REDUCE_SCATTER}
    weights = g.tensors["fc2.weight"].numel
    assert {e.tensor for e in bwd if e.kind is Collective.ALL_GATHER} == {"fc2.weight"}
    assert sum(e.size_bytes for e in fwd) == g.num_params * BF16.weight_bytes
    assert sum(e.size_bytes for e in bwd) == (g.num_params + weights) * BF16.grad_bytes
    # Bus volume: all_gather and reduce_scatter move (n−1)/n of their size, all-reduce 2(n−1)/n.
    fsdp_volume = sum(e.size_bytes for e in cost.events) * 3 / 4
    dp_volume = g.num_params * BF16.grad_bytes * 2 * 3 / 4
    assert fsdp_volume == pytest.approx(dp_volume * (2 * g.num_params + weights) / (2 * g.num_params))
    states = cost.memory["parameters"] + cost.memory["gradients"] + cost.memory["optimizer"]
    assert states == pytest.approx(16 * g.num_params / 4)


def test_gradient_sync_is_bucketed(zoo: Callable[[str], Path]) -> None:
    # DDP fuses gradients into 25 MiB buckets, one all-reduce per bucket. The mlp's gradients (bf16)
    # fit in one: data parallelism pays one all-reduce of all of them, 2(n−1)·α + 2(n−1)/n·Ψ/β,
    # each gradient its bytes' share. An edge priced alone (the ILP's view) pays its share S/Ψ of
    # that latency plus its own bandwidth term — the same total.
    g = load_graph(zoo("mlp"), {"batch": 32})
    n = 4
    mesh = DeviceMesh.build(n, devices_per_node=8)
    cm = CostModel(g, mesh, H100, BF16)
    total = g.num_params * BF16.grad_bytes
    assert total < 25 * 2**20
    w = "fc1.weight"
    size = g.tensors[w].numel * BF16.grad_bytes
    (ev,) = cm.edge_events(w, Spec.replicated(1), Spec.replicated(1), frozenset({0}))
    assert ev.time_s == pytest.approx(2 * (n - 1) * 1e-6 * size / total + 2 * (n - 1) / n * size / 370e9)

    plan = {n.name: next(s for s in strategies_for(n, g, mesh).strategies if str(s.input_specs[0]) == "S(0)")
            for n in g.compute_nodes}
    cost = cm.price(plan)
    syncs = [e for e in cost.events if e.purpose is Purpose.GRAD_SYNC]
    assert {e.tensor for e in syncs} == {p.name for p in g.params}
    assert sum(e.time_s for e in syncs) == pytest.approx(2 * (n - 1) * 1e-6 + 2 * (n - 1) / n * total / 370e9)
    assert cost.comm_s == pytest.approx(sum(e.time_s for e in cost.events))
    # With 4 KiB buckets every bucket pays its own latency.
    small = CostModel(g, mesh, H100, BF16, fusion=CommFusion.uniform(4096)).price(plan)
    packed = pack_buckets({p.name: ((0,), p.numel * BF16.grad_bytes) for p in g.params}, 4096)
    assert len(packed) > 1
    assert small.comm_s == pytest.approx(len(packed) * 2 * (n - 1) * 1e-6 + 2 * (n - 1) / n * total / 370e9)


def test_a_parameters_own_reshard_is_not_bucketed(zoo: Callable[[str], Path]) -> None:
    # A row-parallel bias used as partial (R → P) needs its gradient all-reduced in backward; that
    # all-reduce runs on its own (it is no data-parallel gradient sync): it pays the full latency.
    g = load_graph(zoo("mlp"), {"batch": 32})
    mesh = DeviceMesh.build(4, devices_per_node=8)
    cm = CostModel(g, mesh, H100, BF16)
    b = "fc2.bias"
    (ev,) = cm.edge_events(b, Spec.replicated(1), parse_spec("P"), frozenset({0}))
    assert ev.phase is Phase.BACKWARD and ev.kind is Collective.ALL_REDUCE
    assert ev.time_s == pytest.approx(collective_time_s(H100, mesh, Collective.ALL_REDUCE, ev.size_bytes, (0,)))


def test_graph_ops_pay_the_executor_overhead(zoo: Callable[[str], Path]) -> None:
    # The cpu preset: a graph op pays the executor's per-op overhead (1 forward + 2 backward), a
    # view nothing else.
    cpu = load_profile("cpu")
    dev = cpu.device
    assert dev.graph_op_overhead_s is not None and dev.graph_op_s > dev.kernel_launch_s
    g = load_graph(zoo("gpt2-tiny"), {"batch": 2, "seq": 8})
    mesh = DeviceMesh.build(1)
    cm = CostModel(g, mesh, cpu, PRECISIONS["fp32"])
    view = next(n for n in g.compute_nodes if n.op_type == "Transpose")
    assert cm.node_cost(view, replicated_strategy(OpContext.of(view, g), 1)).compute.total_s == \
        pytest.approx(3 * dev.graph_op_s)


def test_optimizer_step_and_step_overhead_closed_forms(zoo: Callable[[str], Path]) -> None:
    # Without a calibrated optimizer: AdamW's 28 bytes per parameter at memory bandwidth and 12 bare
    # launches per tensor. With one (a, b, c): a + Σ over local tensors (b + c · local numel); the
    # profile's per-step overhead is added to the step once, whatever the plan.
    import dataclasses

    from hwprofiles.profile import OptimizerStep

    g = load_graph(zoo("mlp"), {"batch": 32})
    mesh = DeviceMesh.build(2, devices_per_node=8)
    w = g.tensors["fc1.weight"]
    plain = CostModel(g, mesh, H100, BF16)
    dev = H100.device
    assert plain.states.optimizer_s(w.name, Spec.replicated(1)) == pytest.approx(
        w.numel * 28 / dev.mem_bandwidth_bytes_per_s + 12 * dev.kernel_launch_s)
    opt = OptimizerStep(fixed_s=5e-5, tensor_s=3e-5, param_s=2e-9)
    h = dataclasses.replace(H100, device=dataclasses.replace(dev, optimizer_step=opt, step_overhead_s=2e-4))
    cm = CostModel(g, mesh, h, BF16)
    assert cm.states.optimizer_s(w.name, parse_spec("S(0)")) == pytest.approx(3e-5 + 2e-9 * w.numel / 2)
    choice = {n.name: replicated_strategy(OpContext.of(n, g), 1) for n in g.compute_nodes}
    cost, base = cm.price(choice), plain.price(choice)
    assert cost.optimizer_s == pytest.approx(5e-5 + sum(3e-5 + 2e-9 * p.numel for p in g.params))
    assert cost.overhead_s == 2e-4 and base.overhead_s == 0.0
    assert cost.step_time_s == pytest.approx(cost.compute_s + cost.comm_s + cost.optimizer_s + 2e-4)


def test_reshards_pay_the_executors_host_cost_bucketed_gradients_do_not(zoo: Callable[[str], Path]) -> None:
    # A profile's reshard_overhead_s (DTensor's redistribute, calibrated on CPU) is added to every
    # collective the executor issues on its own; the bucketed gradient all-reduces go through c10d.
    import dataclasses

    base = H100
    extra = 3e-4
    h = dataclasses.replace(base, device=dataclasses.replace(base.device, reshard_overhead_s=extra))
    g = load_graph(zoo("mlp"), {"batch": 32})
    mesh = DeviceMesh.build(4, devices_per_node=8)
    a, b = CostModel(g, mesh, h, BF16), CostModel(g, mesh, base, BF16)
    act = next(t for t in g.tensors.values() if t.kind.name == "ACTIVATION" and len(t.shape) == 2)
    (ea,), (eb,) = (m.edge_events(act.name, Spec((Shard(0),)), Spec.replicated(1), frozenset()) for m in (a, b))
    assert ea.kind is Collective.ALL_GATHER and ea.time_s == pytest.approx(eb.time_s + extra)
    (ga,), (gb,) = (m.edge_events("fc1.weight", Spec.replicated(1), Spec.replicated(1), frozenset({0})) for m in (a, b))
    assert ga.time_s == pytest.approx(gb.time_s)


def test_a_convolution_is_priced_by_its_channels_too(zoo: Callable[[str], Path]) -> None:
    # With a channel curve P·d/(d + d½), a conv of F FLOPs whose implicit GEMM's narrowest dim is d
    # takes F / (peak · max_fraction · d/(d + d½) · F/(F + F½)) (F½: the matmul curve's small-size
    # half point); without one, the matmul time of F.
    import dataclasses

    from costmodel.compute import compute_cost, local_shapes
    from costmodel.flops import conv_channels, node_flops
    from hwprofiles.profile import ChannelCurve

    cpu = load_profile("cpu")
    curve = ChannelCurve(max_fraction=1.2, half_channels=32.0)
    with_curve = dataclasses.replace(cpu, device=dataclasses.replace(cpu.device, conv_efficiency=curve))
    without = dataclasses.replace(cpu, device=dataclasses.replace(cpu.device, conv_efficiency=None))
    g = load_graph(zoo("convnet"), {"batch": 8})
    mesh = DeviceMesh.build(1)
    fp32 = PRECISIONS["fp32"]
    for node in (n for n in g.compute_nodes if n.op_type == "Conv"):
        shapes = local_shapes(node, g, {}, mesh)
        f = node_flops(node, shapes.__getitem__).matmul
        w = g.tensors[node.inputs[1]].shape
        d = conv_channels(node, shapes.__getitem__)
        assert d == min(w[0], w[1] * w[2] * w[3])  # groups = 1
        mm = matmul_time_s(cpu.device, f, "fp32")
        size = f / (f + cpu.device.matmul_efficiency.half_flops)
        expected = f / (cpu.device.peak_for("fp32") * 1.2 * d / (d + 32.0) * size)
        a, b = (compute_cost(node, g, shapes, p, fp32) for p in (with_curve, without))
        assert a.fwd_s - b.fwd_s == pytest.approx(max(expected, a.fwd_bytes / cpu.device.mem_bandwidth_bytes_per_s)
                                                  - max(mm, b.fwd_bytes / cpu.device.mem_bandwidth_bytes_per_s), rel=1e-9)
    assert expected > mm  # the convnet's last conv (32 channels) is bound by its channels here


def test_backward_computes_only_the_gradients_needed(zoo: Callable[[str], Path]) -> None:
    # The first layer reads the batch, which needs no gradient: its backward is one matmul (dW), not
    # two; the second layer's input comes from a parameter: two. Element-wise FLOPs and launches
    # stay; the step's matmul FLOPs count what runs.
    from costmodel.compute import compute_cost, local_shapes

    cpu = load_profile("cpu")
    g = load_graph(zoo("mlp"), {"batch": 256})
    mesh = DeviceMesh.build(1)
    cm = CostModel(g, mesh, cpu, PRECISIONS["fp32"])
    fc1, fc2 = (n for n in g.compute_nodes if n.op_type == "Gemm")
    for node, grads in ((fc1, 1), (fc2, 2)):
        shapes = local_shapes(node, g, {}, mesh)
        a = compute_cost(node, g, shapes, cpu, PRECISIONS["fp32"], needs_grad=cm.needs_grad)
        b = compute_cost(node, g, shapes, cpu, PRECISIONS["fp32"])
        mm = matmul_time_s(cpu.device, a.fwd_matmul_flops, "fp32")
        assert a.fwd_s == b.fwd_s and a.bwd_matmul_flops == grads * a.fwd_matmul_flops
        assert b.bwd_s - a.bwd_s == pytest.approx((2 - grads) * mm)  # compute-bound at 256 rows
    choice = {n.name: replicated_strategy(OpContext.of(n, g), 1) for n in g.compute_nodes}
    assert cm.price(choice).flops_matmul == pytest.approx(2 * 256 * 64 * 256 * (2 + 3))


def _one_matmul(t: int, h: int) -> OpGraph:
    model = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [t, h])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(np.zeros((h, h), np.float32), "w")]),
        opset_imports=[helper.make_opsetid("", 20)])
    return graph_from_proto(model, {})


def test_loss_reduces_a_partial_output_and_reads_rows_where_they_lie() -> None:
    # The output [t, h] looks like logits: cross-entropy. Row-parallel (contracting dim split) leaves it
    # partial: the loss first all-reduces it (t·h bf16 elements, forward, nothing backward). Split by
    # rows it runs in place: no collective, and it keeps its rows' fp32 log-probabilities; its backward
    # holds two more fp32 tensors of their size (NLL's gradient and log-softmax's). Compiled, one fused
    # kernel keeps the bf16 logits and writes their bf16 gradient.
    t, h = 512, 256
    g = _one_matmul(t, h)
    mesh = DeviceMesh.build(2)
    cm = CostModel(g, mesh, H100, BF16)
    assert cm.loss == "cross-entropy"
    partial = cm.node_cost(g.node_by_name["mm"], pick(g, mesh, "mm", "[S(1)] [S(0)] → [P]")).loss
    assert partial is not None
    assert [(e.kind, e.size_bytes, e.phase, e.purpose, e.tensor, e.cadence) for e in partial.events] == \
        [(Collective.ALL_REDUCE, t * h * 2, Phase.FORWARD, Purpose.LOSS, "y", Cadence.MICRO_BATCH)]
    assert partial.saved_bytes == t * h * 4
    rows = cm.node_cost(g.node_by_name["mm"], pick(g, mesh, "mm", "[S(0)] [R] → [S(0)]")).loss
    assert rows is not None and rows.events == () and rows.saved_bytes == t // 2 * h * 4
    assert rows.workspace_bytes == t // 2 * h * 8
    fused = CostModel(g, mesh, H100, BF16, runtime="compiled").node_cost(
        g.node_by_name["mm"], pick(g, mesh, "mm", "[S(0)] [R] → [S(0)]")).loss
    assert fused is not None and (fused.saved_bytes, fused.workspace_bytes) == (t // 2 * h * 2, t // 2 * h * 2)
    dev = H100.device
    assert rows.compute_s == pytest.approx(3 * (3 * t // 2 * h * 4 / dev.elementwise_bytes_per_s + 2 * dev.kernel_launch_s))
    # A class dim split over the mesh is gathered for the softmax; mse takes any split.
    cols = cm.node_cost(g.node_by_name["mm"], pick(g, mesh, "mm", "[R] [S(1)] → [S(1)]")).loss
    assert cols is not None and [e.kind for e in cols.events] == [Collective.ALL_GATHER]
    mse = CostModel(g, mesh, H100, BF16, loss="mse").node_cost(g.node_by_name["mm"],
                                                                pick(g, mesh, "mm", "[R] [S(1)] → [S(1)]")).loss
    assert mse is not None and mse.events == ()


def test_a_split_tensor_made_addends_gets_its_gradient_reduce_scattered(zoo: Callable[[str], Path]) -> None:
    # S(0) → P (an FSDP-stored bias a row-parallel matmul adds as partial sums): forward gathers it and
    # keeps it on one rank; backward, the addends' gradient goes back to the shards in one
    # reduce_scatter of the whole gradient (what DTensor runs), not an all_reduce and a slice.
    g = load_graph(zoo("mlp"), {"batch": 32})
    mesh = DeviceMesh.build(4, devices_per_node=8)
    cm = CostModel(g, mesh, H100, BF16)
    bias = "fc2.bias"
    events = cm.edge_events(bias, parse_spec("S(0)"), parse_spec("P"), frozenset({0}))
    full = g.tensors[bias].numel * BF16.weight_bytes
    assert [(e.kind, e.phase, e.size_bytes) for e in events] == [
        (Collective.ALL_GATHER, Phase.FORWARD, full), (Collective.REDUCE_SCATTER, Phase.BACKWARD, full)]


def test_materialized_attention_kernels_closed_forms() -> None:
    # Per score element S (2-byte activations): Megatron-LM's fused softmax with dropout saves the
    # probabilities (2), the dropout mask (1) and the dropped probabilities (2) — Korthikanti et al.
    # 2022 §4's 5·a·s²·b per layer; without dropout only the probabilities (2·a·s²·b).
    s, q, kv, d = 1e6, 64e3, 64e3, 64.0
    fwd, bwd, saved = materialized_kernels("fused-softmax", scores=s, q=q, kv=kv, head_dim=d, element_bytes=2,
                                           masked=True, dropout=True)
    assert saved == 5 * s
    assert [k.name for k in fwd] == ["QKᵀ", "softmax", "dropout", "P·V"]
    assert sum(k.bytes for k in fwd) == 2 * (q + kv + s) + 4 * s + (4 * s + s) + 2 * (s + kv + q)
    assert sum(k.bytes for k in bwd) == 4 * 2 * (q + kv + s) + (4 * s + s) + 6 * s
    assert sum(k.flops for k in fwd) == 2 * 2 * s * d and sum(k.flops for k in bwd) == 4 * 2 * s * d
    eager, _, saved = materialized_kernels("eager", scores=s, q=q, kv=kv, head_dim=d, element_bytes=2, masked=True,
                                           dropout=False)
    assert [k.name for k in eager] == ["QKᵀ", "mask add", "softmax", "P·V"] and saved == 2 * s
    with pytest.raises(ValueError, match="flash"):
        materialized_kernels("flash", scores=s, q=q, kv=kv, head_dim=d, element_bytes=2, masked=False, dropout=False)


@pytest.mark.parametrize(("kind", "dropout", "saved_per_score"), [("eager", 0.0, 2), ("fused-softmax", 0.1, 5)])
def test_materialized_attention_priced_per_layer(kind: str, dropout: float, saved_per_score: int,
                                                 zoo: Callable[[str], Path]) -> None:
    # GPT-2 medium (24 layers, 16 heads, head dim 64), 2 × 1024 tokens, bf16, one H100: the s×s tensors
    # in memory add saved_per_score bytes per score element to the activations (b·a·s² per layer), and
    # each layer's chain runs at memory bandwidth — head dim 64 keeps QKᵀ and P·V below the H100's ridge
    # — so its time is its bytes over HBM bandwidth plus a launch per kernel.
    b, s, layers, heads, d = 2, 1024, 24, 16, 64
    g = load_graph(zoo("gpt2-medium"), {"batch": b, "seq": s})
    mesh = DeviceMesh.build(1)
    plan = replicated_plan(g, mesh)
    flash = CostModel(g, mesh, H100, BF16).price(plan)
    cm = CostModel(g, mesh, H100, BF16, attention=kind, attention_dropout=dropout)
    mat = cm.price(plan)
    scores = b * heads * s * s
    assert mat.memory["activations"] - flash.memory["activations"] == pytest.approx(layers * saved_per_score * scores)
    assert mat.flops_matmul == flash.flops_matmul
    dev = H100.device
    fwd, bwd, _ = materialized_kernels(kind, scores=scores, q=b * heads * s * d, kv=b * heads * s * d, head_dim=d,
                                       element_bytes=2, masked=True, dropout=dropout > 0)
    assert all(matmul_time_s(dev, k.flops, "bf16") < k.bytes / dev.mem_bandwidth_bytes_per_s for k in fwd + bwd)
    last = next(iter(attention_regions(g).values())).nodes[-1]
    node = cm.node_cost(g.node_by_name[last], plan[last]).compute
    assert node.fwd_s == pytest.approx(sum(k.bytes for k in fwd) / dev.mem_bandwidth_bytes_per_s
                                       + len(fwd) * dev.graph_op_s)
    assert node.bwd_s == pytest.approx(sum(k.bytes for k in bwd) / dev.mem_bandwidth_bytes_per_s
                                       + len(bwd) * dev.graph_op_s)
    assert mat.compute_s > flash.compute_s


def test_elementwise_kernels_priced_at_their_op_types_rate(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    # A profile measuring element-wise kernels by op type (as `profile calibrate` writes it): a Pow
    # (GPT-2's GELU) is priced at the Pow rate — its bytes in + out over that rate, plus the per-op
    # overhead, backward twice the bytes —, an Add at the Add rate, any other op at the mix's; the field
    # survives a save and a load.
    import dataclasses

    from hwprofiles.files import save_profile

    cpu = load_profile("cpu")
    rates = {"Pow": cpu.device.elementwise_bytes_per_s / 3, "Add": cpu.device.elementwise_bytes_per_s * 2}
    prof = dataclasses.replace(cpu, device=dataclasses.replace(cpu.device, elementwise_by_op=rates))
    save_profile(prof, tmp_path / "p.json")
    loaded = load_profile(str(tmp_path / "p.json"))
    assert dict(loaded.device.elementwise_by_op or {}) == pytest.approx(rates)
    g = load_graph(zoo("gpt2-tiny"), {"batch": 2, "seq": 8})
    mesh = DeviceMesh.build(1)
    cm = CostModel(g, mesh, loaded, PRECISIONS["fp32"])
    dev = loaded.device
    for op in ("Pow", "Add", "Tanh"):
        node = next(n for n in g.compute_nodes if n.op_type == op and all(g.tensors[t].is_float for t in n.inputs if t))
        c = cm.node_cost(node, replicated_strategy(OpContext.of(node, g), 1)).compute
        rate = rates.get(op, dev.elementwise_bytes_per_s)
        assert c.fwd_s == pytest.approx(c.fwd_bytes / rate + dev.graph_op_s)
        assert c.bwd_s == pytest.approx(2 * c.fwd_bytes / rate + 2 * dev.graph_op_s)


def test_elementwise_backwards_priced_at_their_calibrated_rates(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    # A profile measuring element-wise backwards by op type (bytes the forward moved per second of
    # backward, every float input needing a gradient, as `profile calibrate` writes it): a Tanh's
    # backward is its forward bytes over that rate plus two launches; a Mul by a constant (GELU's
    # x·0.5) computes one of the two calibrated gradients, so half; a Mul of two activations all of
    # it; an op type not measured (Pow here) keeps 2× its forward. The field survives a save and a load.
    import dataclasses

    from costmodel.memory import gradient_tensors
    from hwprofiles.files import save_profile

    cpu = load_profile("cpu")
    bw = cpu.device.elementwise_bytes_per_s
    rates = {"Tanh": bw * 5, "Mul": bw / 3}
    prof = dataclasses.replace(cpu, device=dataclasses.replace(cpu.device, elementwise_backward_by_op=rates))
    save_profile(prof, tmp_path / "p.json")
    loaded = load_profile(str(tmp_path / "p.json"))
    assert dict(loaded.device.elementwise_backward_by_op or {}) == pytest.approx(rates)
    g = load_graph(zoo("gpt2-tiny"), {"batch": 2, "seq": 8})
    cm = CostModel(g, DeviceMesh.build(1), loaded, PRECISIONS["fp32"])
    dev, grads = loaded.device, gradient_tensors(g)

    def cost(node: OpNode) -> ComputeCost:
        return cm.node_cost(node, replicated_strategy(OpContext.of(node, g), 1)).compute

    def first(op: str, needed: int) -> OpNode:
        return next(n for n in g.compute_nodes if n.op_type == op and sum(t in grads for t in n.inputs if t) == needed
                    and all(g.tensors[t].is_float for t in n.inputs if t))

    tanh, scaled, product, power = first("Tanh", 1), first("Mul", 1), first("Mul", 2), first("Pow", 1)
    assert cost(tanh).bwd_s == pytest.approx(cost(tanh).fwd_bytes / rates["Tanh"] + 2 * dev.graph_op_s)
    assert cost(scaled).bwd_s == pytest.approx(cost(scaled).fwd_bytes / rates["Mul"] / 2 + 2 * dev.graph_op_s)
    assert cost(product).bwd_s == pytest.approx(cost(product).fwd_bytes / rates["Mul"] + 2 * dev.graph_op_s)
    c = cost(power)
    assert c.bwd_s == pytest.approx(2 * (c.fwd_s - dev.graph_op_s) + 2 * dev.graph_op_s)


def test_matmuls_priced_by_their_narrowest_dim(zoo: Callable[[str], Path]) -> None:
    # With a narrow-dim curve (fraction f(d) = P·d/(d + d½) of peak), a matmul is no faster than
    # FLOPs / (peak · f(narrowest of m, k, n)): GPT-2 tiny's QKV projection (k = 64) and its attention
    # scores (per head 64 × 16 · 16 × 64: d = 16) are priced at f(64) and f(16); without the curve,
    # by FLOPs only.
    import dataclasses

    from costmodel.flops import matmul_narrow_dim
    from hwprofiles.profile import ChannelCurve

    cpu = load_profile("cpu")
    curve = ChannelCurve(max_fraction=0.9, half_channels=64.0)
    prof = dataclasses.replace(cpu, device=dataclasses.replace(cpu.device, matmul_narrow_efficiency=curve))
    dev, peak = prof.device, prof.device.peak_for("fp32")
    g = load_graph(zoo("gpt2-tiny"), {"batch": 2, "seq": 64})
    regions = attention_regions(g)
    scores = g.node_by_name[next(iter(regions.values())).nodes[0]]
    linear = next(n for n in g.compute_nodes if n.op_type in ("MatMul", "Gemm") and n.name not in
                  {m for r in regions.values() for m in r.nodes})
    shape = lambda t: g.tensors[t].shape  # noqa: E731
    assert matmul_narrow_dim(scores, shape) == 16 and matmul_narrow_dim(linear, shape) == 64
    for node, d in ((scores, 16), (linear, 64)):
        flops = 2.0 * np.prod(g.tensors[node.outputs[0]].shape) * (16 if node is scores else 64)
        assert matmul_time_s(dev, flops, "fp32", d) == pytest.approx(
            max(flops / (peak * dev.matmul_efficiency.fraction(flops)), flops / (peak * curve.fraction(d))))
        assert matmul_time_s(cpu.device, flops, "fp32", d) == pytest.approx(
            flops / (peak * cpu.device.matmul_efficiency.fraction(flops)))
    assert matmul_time_s(dev, 1e9, "fp32", 16) > matmul_time_s(dev, 1e9, "fp32", 256)


def _data_parallel_plan(g: OpGraph, mesh: DeviceMesh) -> dict[str, OpStrategy]:
    """Every op data parallel on a 1-d mesh: the batch split (on one device, replicated), the rest replicated."""
    batch = "S(0)" if mesh.num_devices > 1 else "R"

    def data_parallel(s: OpStrategy) -> bool:
        return str(s.input_specs[0]) == batch and all(sp is None or str(sp) == "R" for sp in s.input_specs[1:])

    return {node.name: next(filter(data_parallel, strategies_for(node, g, mesh).strategies)) for node in g.compute_nodes}


def test_a_synchronising_step_waits_for_its_slowest_rank(zoo: Callable[[str], Path]) -> None:
    # A profile measuring rank skew r (the slowest rank's excess over the mean for the same work): a
    # step with collectives waits r × its compute more, counted as exposed communication; a step with
    # none (one device) does not wait.
    import dataclasses

    cpu = load_profile("cpu")
    skewed = dataclasses.replace(cpu, device=dataclasses.replace(cpu.device, rank_skew=0.25))
    g = load_graph(zoo("mlp"), {"batch": 64})
    for n, expect_wait in ((2, True), (1, False)):
        mesh = DeviceMesh.build(n)
        plan = _data_parallel_plan(g, mesh)
        plain = CostModel(g, mesh, cpu, PRECISIONS["fp32"]).price(plan)
        waits = CostModel(g, mesh, skewed, PRECISIONS["fp32"]).price(plan)
        assert waits.compute_s == pytest.approx(plain.compute_s)
        assert waits.comm_s - plain.comm_s == pytest.approx(0.25 * plain.compute_s if expect_wait else 0.0)
        assert bool(plain.events) is expect_wait


def test_each_collective_call_pays_the_profiles_collective_wait(zoo: Callable[[str], Path]) -> None:
    # A profile measuring a collective wait w (a collective entered after compute against back to
    # back): every collective call costs its link time + w, a hierarchical one once per stage of it;
    # a step prices w once per collective call it makes — the data-parallel mlp's gradients, all in
    # one 25 MiB bucket, one all-reduce —; one device makes none.
    import dataclasses

    cpu = load_profile("cpu")
    w = 1e-3
    waiting = dataclasses.replace(cpu, device=dataclasses.replace(cpu.device, collective_wait_s=w))
    for kind in Collective:
        for size in (4.0, 65536.0, 2.0**24):
            assert link_collective_time_s(waiting, kind, size, 2, LinkLevel.INTRA_NODE) == pytest.approx(
                link_collective_time_s(cpu, kind, size, 2, LinkLevel.INTRA_NODE) + w)
    h100 = load_profile("h100-sxm")
    nodes = dataclasses.replace(h100, device=dataclasses.replace(h100.device, collective_wait_s=w))
    two_nodes = DeviceMesh.build(16, (16,), devices_per_node=8)
    for kind, stages in ((Collective.ALL_REDUCE, 3), (Collective.ALL_GATHER, 2), (Collective.SEND_RECV, 1)):
        assert collective_time_s(nodes, two_nodes, kind, 2.0**20, (0,)) == pytest.approx(
            collective_time_s(h100, two_nodes, kind, 2.0**20, (0,)) + stages * w)
    g = load_graph(zoo("mlp"), {"batch": 64})
    for n in (2, 1):
        mesh = DeviceMesh.build(n)
        plan = _data_parallel_plan(g, mesh)
        plain = CostModel(g, mesh, cpu, PRECISIONS["fp32"]).price(plan)
        waits = CostModel(g, mesh, waiting, PRECISIONS["fp32"]).price(plan)
        assert all(e.kind is Collective.ALL_REDUCE and e.purpose is Purpose.GRAD_SYNC for e in plain.events)
        assert sum(e.size_bytes for e in plain.events) < 25 * 2**20
        calls = 1 if plain.events else 0
        assert waits.compute_s == pytest.approx(plain.compute_s)
        assert waits.comm_s - plain.comm_s == pytest.approx(w * calls)
        assert (calls > 0) is (n > 1)


def test_reshape_of_a_strided_tensor_is_a_view_only_when_it_splits_dims() -> None:
    # torch.reshape of a non-contiguous tensor (a split's piece, a transpose) is a view when every old
    # dim is a product of consecutive new ones (splitting heads out of a q slice); merging dims copies.
    from costmodel.memory import _splits_only

    assert _splits_only((8, 64, 64), (8, 64, 4, 16))
    assert _splits_only((512, 64), (8, 64, 64))
    assert _splits_only((1, 64), (64,)) and _splits_only((64,), (1, 64, 1))
    assert not _splits_only((8, 64, 4, 16), (8, 64, 64))
    assert not _splits_only((8, 64, 64), (8, 4096))
