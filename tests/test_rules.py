"""Every sharding rule, checked numerically on simulated ranks.

For each case (one ONNX node with small shapes) and each mesh (2), (4), (2, 2): enumerate the node's
strategies, split the inputs per strategy (Partial inputs as random addends), run the node per rank
with onnx.reference, reassemble the outputs per the strategy's output specs, and compare with the
unsharded node. A wrong or missing rule fails here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from core.graph import OpGraph
from core.mesh import DeviceMesh
from core.placement import OpStrategy, R, Shard, Spec
from planner.graph import graph_from_proto
from planner.rules import has_rule, registered_ops, strategies_for
from planner.rules.conv import SPLIT_GROUPS
from planner.rules.gather import MASKED_GATHER
from tests.spmd import coords, local_shape, run_node, shard, unshard

MESHES = [(2,), (4,), (2, 2)]


@dataclass
class Case:
    op: str
    inputs: Sequence[Any]  # a shape (random float input), ("int", shape, high), ("bool", shape), or an np.ndarray constant
    attrs: dict[str, Any] = field(default_factory=dict)
    n_out: int = 1
    name: str = ""
    positive: bool = False  # Sqrt, Reciprocal, Pow: keep inputs away from 0
    opset: int = 20

    @property
    def id(self) -> str:
        return self.name or self.op


def c(*values: Any, dtype: Any = np.int64) -> np.ndarray:
    return np.array(values, dtype=dtype)


CASES = [
    Case("MatMul", [(4, 8), (8, 4)], name="MatMul-2d"),
    Case("MatMul", [(2, 4, 8), (8, 6)], name="MatMul-batched-weight"),
    Case("MatMul", [(2, 4, 8), (2, 8, 4)], name="MatMul-bmm"),
    Case("MatMul", [(2, 1, 4, 8), (4, 8, 4)], name="MatMul-broadcast"),
    Case("Gemm", [(4, 8), (8, 6), (6,)], name="Gemm-bias"),
    Case("Gemm", [(4, 8), (6, 8), (6,)], {"transB": 1}, name="Gemm-transB"),
    Case("Gemm", [(8, 4), (8, 6)], {"transA": 1}, name="Gemm-transA-nobias"),
    Case("Conv", [(2, 4, 6, 6), (8, 4, 3, 3), (8,)], {"pads": [1, 1, 1, 1]}, name="Conv"),
    Case("Conv", [(2, 4, 6, 6), (4, 1, 3, 3)], {"group": 4, "pads": [1, 1, 1, 1]}, name="Conv-depthwise"),
    Case("Add", [(4, 8), (8,)], name="Add-broadcast"),
    Case("Add", [(4, 8), (4, 8)], name="Add"),
    Case("Add", [(4, 8), c(1.5, dtype=np.float32)], name="Add-const"),
    Case("Sub", [(4, 8), (4, 1)], name="Sub"),
    Case("Mul", [(4, 8), (4, 8)], name="Mul"),
    Case("Mul", [(2, 4, 8), c(0.5, dtype=np.float32)], name="Mul-const"),
    Case("Div", [(4, 8), (8,)], positive=True, name="Div"),
    Case("Pow", [(4, 8), c(2.0, dtype=np.float32)], name="Pow"),
    Case("Max", [(4, 8), (4, 8)], name="Max"),
    Case("Where", [("bool", (4, 8)), (4, 8), (8,)], name="Where"),
    Case("Equal", [("int", (4, 8), 3), ("int", (4, 8), 3)], name="Equal"),
    Case("And", [("bool", (4, 8)), ("bool", (4, 8))], name="And"),
    Case("Add", [(5, 4), (5, 4)], name="Add-uneven"),
    *[Case(op, [(4, 8)], positive=op in ("Sqrt", "Reciprocal")) for op in
      ("Relu", "Tanh", "Sigmoid", "Erf", "Gelu", "Neg", "Sqrt", "Reciprocal", "Identity", "IsNaN", "Exp")],
    Case("Cast", [(4, 8)], {"to": TensorProto.DOUBLE}),
    Case("CastLike", [(4, 8), ("int", (2,), 3)]),
    Case("Dropout", [(4, 8)]),
    Case("Not", [("bool", (4, 8))]),
    Case("Softmax", [(2, 4, 8)], {"axis": -1}),
    Case("LayerNormalization", [(2, 4, 8), (8,), (8,)], {"axis": -1}),
    Case("BatchNormalization", [(2, 4, 3, 3), (4,), (4,), (4,), (4,)], positive=True),
    Case("ReduceMean", [(4, 8), c(-1)], {"keepdims": 1}, name="ReduceMean-keepdims"),
    Case("ReduceMean", [(4, 8, 4), c(1)], {"keepdims": 0}, name="ReduceMean-drop"),
    Case("ReduceSum", [(4, 6, 8), c(1)], {"keepdims": 0}, name="ReduceSum"),
    Case("GlobalAveragePool", [(2, 4, 3, 3)]),
    Case("MaxPool", [(2, 4, 4, 4)], {"kernel_shape": [2, 2], "strides": [2, 2]}),
    Case("AveragePool", [(2, 4, 4, 4)], {"kernel_shape": [2, 2]}),
    Case("Reshape", [(2, 4, 8), c(8, 8)], name="Reshape-merge"),
    Case("Reshape", [(8, 8), c(2, 4, 8)], name="Reshape-split"),
    Case("Reshape", [(2, 4, 8), c(2, 4, 2, 4)], name="Reshape-heads"),
    Case("Reshape", [(2, 4, 1, 8), c(8, 8)], name="Reshape-ones"),
    Case("Flatten", [(2, 4, 3, 3)], {"axis": 1}),
    Case("Transpose", [(2, 4, 8)], {"perm": [0, 2, 1]}),
    Case("Squeeze", [(4, 1, 8), c(1)]),
    Case("Unsqueeze", [(4, 8), c(1)]),
    Case("Expand", [(4, 1), c(4, 8)]),
    Case("Slice", [(4, 8), c(0), c(4), c(1)], name="Slice"),
    Case("Concat", [(4, 2), (4, 6)], {"axis": 1}),
    Case("Split", [(4, 8), c(3, 5)], {"axis": 1}, n_out=2),
    Case("Gather", [(16, 8), ("int", (2, 4), 16)], {"axis": 0}, name="Gather-embedding"),
    Case("Gather", [(4, 8, 4), ("int", (3,), 8)], {"axis": 1}, name="Gather-axis1"),
    Case("GatherElements", [(4, 8), ("int", (4, 8), 8)], {"axis": 1}),
    Case("GatherND", [(4, 6, 8), ("int", (4, 2, 1), 6)], {"batch_dims": 1}),
    Case("GatherND", [(4, 6, 8), ("int", (8, 1), 4)], {"batch_dims": 0}, name="GatherND-experts"),
    Case("TopK", [(8, 6), c(2)], {"axis": -1}, n_out=2, name="TopK-router"),
    # The dynamo exporter's `q[..., :k] = y`: the sliced dim transposed to the front, rows written.
    Case("ScatterND", [(6, 4, 8), np.array([[1], [4]]), (2, 4, 8)], name="ScatterND-slice-assign"),
    Case("ScatterND", [(6, 4, 8), np.array([[1], [4]]), (2, 4, 8)], {"reduction": "add"}, name="ScatterND-add"),
    # Group-limited routing's mask: ones scattered at each token's chosen groups.
    Case("ScatterElements", [(8, 6), np.array([[0, 2], [1, 5], [3, 4], [0, 1]] * 2), (8, 2)], {"axis": 1},
         name="ScatterElements-groups"),
    # Opsets 7–23 as found in the wild (the onnx wheel's model-zoo CNNs, newer exporters).
    Case("Sum", [(4, 8), (8,), (4, 8)], name="Sum-variadic"),
    Case("Mean", [(4, 8), (4, 8)], name="Mean"),
    Case("Min", [(4, 8), (4, 1), (4, 8)], name="Min-variadic"),
    Case("LRN", [(2, 8, 4, 4)], {"size": 3, "alpha": 1e-3, "beta": 0.75, "bias": 1.0}),
    Case("MaxPool", [(2, 4, 5, 5)], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [0, 0, 1, 1]},
         name="MaxPool-asymmetric-pads"),
    Case("MaxPool", [(2, 4, 5, 5)], {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}, name="MaxPool-ceil"),
    Case("AveragePool", [(2, 4, 5, 5)], {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}, name="AveragePool-pads"),
    Case("AveragePool", [(2, 4, 5, 5)], {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 1},
         name="AveragePool-count-pad"),
    Case("AveragePool", [(2, 4, 6, 6)], {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"},
         name="AveragePool-same-upper"),
    Case("GlobalMaxPool", [(2, 4, 3, 3)]),
    Case("Upsample", [(2, 4, 3, 3), c(1.0, 1.0, 2.0, 2.0, dtype=np.float32)], {"mode": "nearest"}, opset=9),
    Case("Resize", [(2, 4, 3, 3), np.zeros(0, np.float32), c(1.0, 1.0, 2.0, 2.0, dtype=np.float32)],
         {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"},
         opset=13, name="Resize-nearest"),
    Case("Resize", [(2, 4, 3, 3), np.zeros(0, np.float32), c(1.0, 1.0, 2.0, 2.0, dtype=np.float32)],
         {"mode": "linear"}, name="Resize-linear"),
    Case("Einsum", [(2, 4, 8), (2, 8, 6)], {"equation": "bij,bjk->bik"}, name="Einsum-bmm"),
    Case("Einsum", [(2, 3, 4, 8), (2, 3, 5, 8)], {"equation": "bhqd,bhkd->bhqk"}, name="Einsum-scores"),
    Case("Einsum", [(4, 8), (8,)], {"equation": "ij,j"}, name="Einsum-implicit"),
    Case("LogSoftmax", [(2, 4, 8)], {"axis": -1}),
    Case("Clip", [(4, 8), c(-0.5, dtype=np.float32), c(0.5, dtype=np.float32)], name="Clip-inputs"),
    Case("Clip", [(4, 8)], {"min": -0.5, "max": 0.5}, opset=7, name="Clip-attrs"),
    Case("LeakyRelu", [(4, 8)], {"alpha": 0.1}),
    Case("HardSigmoid", [(4, 8)], {"alpha": 0.3, "beta": 0.4}),
    Case("Dropout", [(4, 8)], {"ratio": 0.3}, opset=7, name="Dropout-ratio-attr"),
    Case("Dropout", [(4, 8), np.array(0.3, np.float32)], n_out=2, name="Dropout-mask"),
    Case("BatchNormalization", [(2, 4, 3, 3), (4,), (4,), (4,), (4,)], {"training_mode": 1}, n_out=3,
         positive=True, opset=15, name="BatchNorm-training"),
    Case("Gelu", [(4, 8)], {"approximate": "tanh"}, name="Gelu-tanh"),
    Case("RMSNormalization", [(2, 4, 8), (8,)], {"axis": -1}, opset=23),
    Case("Flatten", [(2, 4, 3, 3)], {"axis": 2}, opset=9, name="Flatten-9"),
]


def build(case: Case) -> tuple[OpGraph, onnx.NodeProto, list[np.ndarray]]:
    rng = np.random.default_rng(abs(hash(case.id)) % 2**32)
    names, graph_inputs, inits, values = [], [], [], []
    for i, spec in enumerate(case.inputs):
        name = f"in{i}"
        names.append(name)
        if isinstance(spec, np.ndarray):
            inits.append(numpy_helper.from_array(spec, name))
            values.append(spec)
            continue
        if isinstance(spec, tuple) and spec and spec[0] == "int":
            v = rng.integers(0, spec[2], size=spec[1]).astype(np.int64)
        elif isinstance(spec, tuple) and spec and spec[0] == "bool":
            v = rng.random(spec[1]) > 0.5
        else:
            v = rng.standard_normal(spec).astype(np.float32)
            if case.positive:
                v = np.abs(v) + 0.5
        graph_inputs.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape)))
        values.append(v)
    outs = [f"out{j}" for j in range(case.n_out)]
    node = helper.make_node(case.op, names, outs, name="n", **case.attrs)
    model = helper.make_model(
        helper.make_graph([node], "case", graph_inputs, [helper.make_tensor_value_info(o, 0, None) for o in outs],
                          initializer=inits),
        opset_imports=[helper.make_opsetid("", case.opset)],
    )
    model.ir_version = min(model.ir_version, 10)  # what onnx.reference reads at every opset here
    return graph_from_proto(model, {}), node, values


def _masked_gather(data: np.ndarray, idx: np.ndarray, rows: np.ndarray, axis: int) -> np.ndarray:
    """Vocab-parallel gather on one rank: ids outside the local rows look up zeros."""
    local = idx - rows[0] if len(rows) else idx
    inside = (local >= 0) & (local < len(rows))
    out = np.take(data, np.where(inside, local, 0), axis=axis)
    mask = inside.reshape((1,) * axis + inside.shape + (1,) * (data.ndim - axis - 1))
    return np.where(mask, out, 0).astype(data.dtype)


def run_strategy(case: Case, graph: OpGraph, node: onnx.NodeProto, values: list[np.ndarray], strategy: OpStrategy,
                 mesh_shape: tuple[int, ...]) -> list[np.ndarray]:
    per_input = []
    for i, v in enumerate(values):
        s = strategy.input_specs[i]
        per_input.append(shard(v, s, mesh_shape) if s is not None else None)
    out_shapes = [graph.tensors[o].shape for o in node.output]
    results: dict[tuple[int, ...], list[np.ndarray]] = {}
    for co in coords(mesh_shape):
        local = [p[co] if p is not None else values[i] for i, p in enumerate(per_input)]
        if case.op in ("Reshape", "Expand"):  # a shape operand describes the *local* output
            local[1] = np.array(local_shape(out_shapes[0], strategy.output_specs[0], mesh_shape, co), dtype=np.int64)
        if SPLIT_GROUPS in strategy.kernels:  # depthwise conv on a channel slice: one group per local channel
            local_node = helper.make_node("Conv", list(node.input), list(node.output), name="n",
                                          **{**case.attrs, "group": local[0].shape[1]})
            results[co] = run_node(local_node, local, case.opset)
        elif MASKED_GATHER in strategy.kernels:
            axis = int(case.attrs.get("axis", 0))
            vocab = values[0].shape[axis]
            only_axis = Spec(tuple(Shard(0) if isinstance(p, Shard) and p.dim == axis else R
                                   for p in strategy.input_specs[0].placements))
            rows = shard(np.arange(vocab), only_axis, mesh_shape)[co]
            results[co] = [_masked_gather(local[0], local[1], rows, axis)]
        else:
            results[co] = run_node(node, local, case.opset)
    return [unshard({co: r[j] for co, r in results.items()}, strategy.output_specs[j], mesh_shape)
            for j in range(case.n_out)]


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda m: "x".join(map(str, m)))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_rule_numerically(case: Case, mesh_shape: tuple[int, ...]) -> None:
    graph, node, values = build(case)
    (opnode,) = graph.compute_nodes
    assert has_rule(case.op), f"{case.op} has no rule"
    mesh = DeviceMesh.build(int(np.prod(mesh_shape)), mesh_shape)
    ns = strategies_for(opnode, graph, mesh)
    expected = run_node(node, values, case.opset)
    # More than the replicated strategy, unless no dim is large enough to split.
    assert len(ns.strategies) > 1
    for strategy in ns.strategies:
        got = run_strategy(case, graph, node, values, strategy, mesh_shape)
        for e, g in zip(expected, got, strict=True):
            np.testing.assert_allclose(g.astype(np.float64), e.astype(np.float64), rtol=1e-4, atol=1e-4,
                                       err_msg=f"{case.id} on mesh {mesh_shape}: {strategy}")


def test_matmul_strategy_counts() -> None:
    """[M,K]@[K,N] on one axis: replicate, split M, split N, split K (→ P), and P·R, R·P → P = 6;
    the issue's 'basic' four are the splits and the replication. On 2×2 the product of the six,
    less the combinations whose dims cannot split 4 ways (none here): 36."""
    graph, _, _ = build(Case("MatMul", [(8, 8), (8, 8)]))
    (n,) = graph.compute_nodes
    basic = [s for s in strategies_for(n, graph, DeviceMesh.build(4)).strategies
             if not any(sp.has_partial for sp in s.input_specs if sp is not None)]
    assert len(basic) == 4
    on_2x2 = strategies_for(n, graph, DeviceMesh.build(4, (2, 2))).strategies
    assert len([s for s in on_2x2 if not any(sp.has_partial for sp in s.input_specs if sp is not None)]) == 16
    assert len(on_2x2) == 36


ISSUE_OPS = {
    "MatMul", "Gemm", "Conv", "Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Reciprocal", "Neg", "Tanh", "Sigmoid",
    "Erf", "Gelu", "Relu", "Where", "IsNaN", "Cast", "CastLike", "Equal", "And", "Max", "Dropout", "Identity",
    "Softmax", "LayerNormalization", "BatchNormalization", "ReduceMean", "ReduceSum", "Reshape", "Transpose",
    "Split", "Slice", "Concat", "Unsqueeze", "Squeeze", "Expand", "Flatten", "Gather", "GatherND",
    "GatherElements", "MaxPool", "AveragePool", "GlobalAveragePool",
}


def test_issue_ops_have_rules_and_cases() -> None:
    assert registered_ops() >= ISSUE_OPS
    assert {c.op for c in CASES} >= ISSUE_OPS


def test_every_rule_function_has_a_case() -> None:
    from planner.rules.registry import _RULES

    tested = {_RULES[c.op] for c in CASES} | {_RULES["SplitToSequence"], _RULES["SequenceAt"]}
    assert tested == set(_RULES.values())



def test_sequence_split_and_at_numerically() -> None:
    """SplitToSequence → SequenceAt (how the dynamo exporter writes torch.split): the sequence value
    carries the split tensor's placements; chained strategies must reproduce the unsharded run."""
    x = np.random.default_rng(0).standard_normal((4, 12)).astype(np.float32)
    split, pos = np.array([4, 8], np.int64), np.array(1, np.int64)
    nodes = [helper.make_node("SplitToSequence", ["x", "split"], ["seq"], axis=1, name="s"),
             helper.make_node("SequenceAt", ["seq", "pos"], ["y"], name="a")]
    model = helper.make_model(helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 12])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],  # declared, as exporters do
        initializer=[numpy_helper.from_array(split, "split"), numpy_helper.from_array(pos, "pos")]),
        opset_imports=[helper.make_opsetid("", 20)])
    graph = graph_from_proto(model, {})
    assert graph.tensors["seq"].shape == (4, 12)
    from onnx.reference import ReferenceEvaluator

    expected = ReferenceEvaluator(model).run(None, {"x": x})[0]
    for mesh_shape in MESHES:
        mesh = DeviceMesh.build(int(np.prod(mesh_shape)), mesh_shape)
        split_s = strategies_for(graph.node_by_name["s"], graph, mesh).strategies
        at_s = strategies_for(graph.node_by_name["a"], graph, mesh).strategies
        chained = [(s, a) for s in split_s for a in at_s if a.input_specs[0] == s.output_specs[0]]
        assert len(chained) > 1
        for s, a in chained:
            parts = shard(x, s.input_specs[0], mesh_shape)
            ys = {co: ReferenceEvaluator(model).run(None, {"x": v})[0] for co, v in parts.items()}
            np.testing.assert_allclose(unshard(ys, a.output_specs[0], mesh_shape), expected, rtol=1e-5)


def test_scatter_partial_only_where_no_place_is_written_twice() -> None:
    """Overwriting scatters are linear in (data, updates) only where each place is written once (which
    duplicate wins is undefined): with a repeated index, or indices not known, no Partial; adding ones
    always."""
    def partial(case: Case) -> bool:
        graph, _, _ = build(case)
        (n,) = graph.compute_nodes
        return any(s.input_specs[0] is not None and s.input_specs[0].has_partial
                   for s in strategies_for(n, graph, DeviceMesh.build(2)).strategies)

    data, upd = (6, 4, 8), (2, 4, 8)
    assert partial(Case("ScatterND", [data, np.array([[1], [4]]), upd]))
    assert not partial(Case("ScatterND", [data, np.array([[1], [1]]), upd]))
    assert not partial(Case("ScatterND", [data, ("int", (2, 1), 6), upd]))  # indices computed: not known
    assert partial(Case("ScatterND", [data, ("int", (2, 1), 6), upd], {"reduction": "add"}))
    assert not partial(Case("ScatterElements", [(4, 6), np.array([[0, 0]] * 4), (4, 2)], {"axis": 1}))
