"""OpGraph import on hand-built ONNX graphs (and one zoo model): dims binding, tensor kinds, constant
folding, layers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from core.errors import DimBindingError, ModelError
from core.graph import TensorKind, numbered_levels
from planner.graph import graph_from_proto, load_graph


def _linear_stack(num_layers: int, hidden: int = 8) -> onnx.ModelProto:
    """x[batch, seq, h] → num_layers × (MatMul W_i + bias_i, Relu) → Reshape to [batch*seq, h].

    The Reshape target comes from a Shape→Gather→Mul→Concat chain, as exporters write it, and node
    names follow the legacy exporter ("/layers.3/MatMul") so that module paths are recoverable.
    """
    nodes, inits = [], []
    prev = "x"
    rng = np.random.default_rng(0)
    for i in range(num_layers):
        w, b = f"layers.{i}.w", f"layers.{i}.b"
        inits += [numpy_helper.from_array(rng.standard_normal((hidden, hidden)).astype(np.float32), w),
                  numpy_helper.from_array(np.zeros(hidden, np.float32), b)]
        nodes += [helper.make_node("MatMul", [prev, w], [f"mm{i}"], name=f"/layers.{i}/MatMul"),
                  helper.make_node("Add", [f"mm{i}", b], [f"add{i}"], name=f"/layers.{i}/Add"),
                  helper.make_node("Relu", [f"add{i}"], [f"h{i}"], name=f"/layers.{i}/Relu")]
        prev = f"h{i}"
    inits += [numpy_helper.from_array(np.array([0], np.int64), "i0"),
              numpy_helper.from_array(np.array([1], np.int64), "i1"),
              numpy_helper.from_array(np.array([hidden], np.int64), "hdim")]
    nodes += [
        helper.make_node("Shape", [prev], ["shp"], name="/Shape"),
        helper.make_node("Gather", ["shp", "i0"], ["d0"], name="/Gather"),
        helper.make_node("Gather", ["shp", "i1"], ["d1"], name="/Gather_1"),
        helper.make_node("Mul", ["d0", "d1"], ["rows"], name="/Mul"),
        helper.make_node("Concat", ["rows", "hdim"], ["target"], axis=0, name="/Concat"),
        helper.make_node("Reshape", [prev, "target"], ["y"], name="/Reshape"),
    ]
    graph = helper.make_graph(
        nodes, "stack",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_dims_bound_and_shapes_static() -> None:
    g = graph_from_proto(_linear_stack(3), {"batch": 2, "seq": 5})
    assert g.tensors["x"].shape == (2, 5, 8)
    assert g.tensors["h2"].shape == (2, 5, 8)
    assert g.tensors["y"].shape == (10, 8)  # through the Shape→Gather→Mul→Concat chain
    assert g.dims == {"batch": 2, "seq": 5}


def test_tensor_kinds_and_params() -> None:
    g = graph_from_proto(_linear_stack(3), {"batch": 2, "seq": 5})
    assert g.tensors["x"].kind is TensorKind.INPUT
    assert g.tensors["layers.0.w"].kind is TensorKind.PARAM
    assert g.tensors["layers.0.b"].kind is TensorKind.PARAM
    assert g.tensors["i0"].kind is TensorKind.CONSTANT  # int initializer
    assert g.tensors["h0"].kind is TensorKind.ACTIVATION
    # 3 layers × (8·8 weights + 8 biases)
    assert g.num_params == 3 * (64 + 8)
    assert g.param_bytes == 4 * g.num_params


def test_constant_subgraph_marked() -> None:
    g = graph_from_proto(_linear_stack(2), {"batch": 2, "seq": 5})
    assert {"/Shape", "/Gather", "/Gather_1", "/Mul", "/Concat"} <= g.constant_nodes
    assert g.tensors["target"].kind is TensorKind.CONSTANT
    assert "/Reshape" not in g.constant_nodes
    assert [n.op_type for n in g.compute_nodes] == ["MatMul", "Add", "Relu"] * 2 + ["Reshape"]


def test_digraph_edges_carry_tensors() -> None:
    g = graph_from_proto(_linear_stack(2), {"batch": 2, "seq": 5})
    assert g.graph.edges["/layers.0/Relu", "/layers.1/MatMul"]["tensors"] == ("h0",)
    assert g.producer["h1"] == "/layers.1/Relu"


def test_repeated_layers_found_and_aligned() -> None:
    g = graph_from_proto(_linear_stack(4), {"batch": 2, "seq": 5})
    assert len(g.layers) == 1
    group = g.layers[0]
    assert group.prefix == "layers" and group.indices == (0, 1, 2, 3)
    assert group.nodes[2] == ("/layers.2/MatMul", "/layers.2/Add", "/layers.2/Relu")


def test_numbered_levels() -> None:
    assert numbered_levels("model.layers.3.mlp.0.fc") == [("model.layers", 3), ("model.layers.3.mlp", 0)]
    assert numbered_levels("stem.conv") == []


def test_fingerprint_tracks_shapes_not_names() -> None:
    a = graph_from_proto(_linear_stack(2), {"batch": 2, "seq": 5})
    b = graph_from_proto(_linear_stack(2), {"batch": 2, "seq": 5})
    c = graph_from_proto(_linear_stack(2), {"batch": 4, "seq": 5})
    assert a.fingerprint == b.fingerprint != c.fingerprint


@pytest.mark.parametrize(
    ("dims", "message"),
    [
        ({}, "unbound symbolic dims: batch, seq; bind them with `dims` batch=N `dims` seq=N"),
        ({"batch": 2}, "unbound symbolic dims: seq"),
        ({"batch": 2, "seq": 5, "heads": 4}, "`dims` names heads not in the model"),
        ({"batch": 0, "seq": 5}, "must be a positive integer"),
    ],
)
def test_dim_binding_errors(dims: dict[str, int], message: str) -> None:
    with pytest.raises(DimBindingError, match=message.replace("(", r"\(")):
        graph_from_proto(_linear_stack(1), dims)


def test_positions_beyond_the_table_are_a_binding_error(zoo: Callable[[str], Path]) -> None:
    # gpt2-tiny's position embedding has 64 rows, read at Range(0, seq): seq = 64 fits, 65 does not.
    load_graph(zoo("gpt2-tiny"), {"batch": 2, "seq": 64})
    with pytest.raises(DimBindingError, match=r"reads row 64 of model.transformer.wpe.weight, which has 64 rows, "
                                              r"at seq=65: .* bind that dim to at most 64"):
        load_graph(zoo("gpt2-tiny"), {"batch": 2, "seq": 65})


def test_shape_only_initializers_not_read(tmp_path: Path) -> None:
    """Initializers declared with absent external data import without reading any weights."""
    model = _linear_stack(2)
    for init in model.graph.initializer:
        if init.name.startswith("layers."):
            init.ClearField("raw_data")
            init.ClearField("float_data")
            init.data_location = TensorProto.EXTERNAL
            init.external_data.add(key="location", value="absent.bin")
    path = tmp_path / "shape_only.onnx"
    onnx.save(model, str(path))
    assert not (tmp_path / "absent.bin").exists()
    g = load_graph(path, {"batch": 2, "seq": 5})
    assert g.num_params == 2 * (64 + 8)


def test_load_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="no such file"):
        load_graph(tmp_path / "missing.onnx")
    (tmp_path / "empty.onnx").write_bytes(b"")
    with pytest.raises(ModelError, match="empty"):
        load_graph(tmp_path / "empty.onnx")
    empty_graph = helper.make_model(helper.make_graph([], "g", [], []))
    onnx.save(empty_graph, str(tmp_path / "nodes.onnx"))
    with pytest.raises(ModelError, match="no nodes"):
        load_graph(tmp_path / "nodes.onnx")


def _flattened_transpose(unmerge: tuple[int, ...]) -> onnx.ModelProto:
    """x[2, 3, 4, 5] → Reshape [6, 4, 5] → Transpose(0, 2, 1) → Reshape `unmerge` → Relu: the dynamo
    exporter's `key.transpose(-2, -1)` inside attention, with batch and heads merged."""
    inits = [numpy_helper.from_array(np.array([6, 4, 5], np.int64), "merged"),
             numpy_helper.from_array(np.array(unmerge, np.int64), "unmerged")]
    nodes = [helper.make_node("Reshape", ["x", "merged"], ["m"], name="merge"),
             helper.make_node("Transpose", ["m"], ["t"], perm=[0, 2, 1], name="transpose"),
             helper.make_node("Reshape", ["t", "unmerged"], ["u"], name="unmerge"),
             helper.make_node("Relu", ["u"], ["y"], name="relu")]
    graph = helper.make_graph(nodes, "flat", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_flattened_transpose_imports_as_one_transpose() -> None:
    """The chain is one 4-D Transpose of the last two dims (batch and heads never merged, so a plan may
    split them over two axes), and it computes what the chain computes."""
    import torch

    from executor.ops import run_op

    g = graph_from_proto(_flattened_transpose((2, 3, 5, 4)), {})
    compute = [n for n in g.nodes if n.name not in g.constant_nodes]
    assert [(n.op_type, n.inputs, n.outputs, n.attr("perm")) for n in compute] == \
        [("Transpose", ("x",), ("u",), (0, 1, 3, 2)), ("Relu", ("u",), ("y",), None)]
    x = torch.randn(2, 3, 4, 5)
    (got,) = run_op(compute[0], [x])
    assert torch.equal(got, x.reshape(6, 4, 5).transpose(1, 2).reshape(2, 3, 5, 4))
    # Split again into other leading dims: not a transpose of x, kept as written.
    g = graph_from_proto(_flattened_transpose((3, 2, 5, 4)), {})
    assert [n.op_type for n in g.nodes if n.name not in g.constant_nodes] == ["Reshape", "Transpose", "Reshape", "Relu"]


@pytest.mark.parametrize("name", ["mixtral-tiny", "gpt2-tiny", "llama-tiny"])
def test_large_batch_shapes_equal_full_inference(zoo: Callable[[str], Path], name: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Above batch 4 the import carries the shapes at batches 1, 2, 3 and 7 along their affine course
    (`planner/shapes.py`): every tensor's shape equals ONNX's full inference at that batch."""
    import planner.shapes

    dims = {"batch": 12, "seq": 16}
    assert planner.shapes._extrapolated(onnx.load(zoo(name), load_external_data=False), dims) is not None
    carried = load_graph(zoo(name), dims)
    monkeypatch.setattr(planner.shapes, "EXTRAPOLATE_ABOVE", 10**9)
    full = load_graph(zoo(name), dims)
    assert carried.tensors.keys() == full.tensors.keys()
    assert {t: i.shape for t, i in carried.tensors.items()} == {t: i.shape for t, i in full.tensors.items()}
