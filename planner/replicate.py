"""Deepen an exported ONNX graph by repeating its last transformer layer: a 2-layer export becomes
an 80-layer one (a model whose first layers differ — DeepSeek-V3's 3 dense layers before 58 of
experts — is exported with those and two of the rest, and its last layer repeated). Used by `meshplan export` (planner/export.py) on shape-only models, where tracing
80 layers through torch.export and the ONNX translator takes minutes and repeats one layer's work
80 times; the result is the graph the full export gives, up to the names of its values.

Layers are the nodes whose module path (the exporter's `name_scopes`) lies under `{prefix}.{i}`,
e.g. `model.model.layers.1`. With the source's last two layers f and f+1 (f = 0 unless its first
layers differ), layer f+1 is copied as layers f+2 … L−1: a copy's node reads its own copy's values
where layer f+1 read its own, the previous layer's values where layer f+1 read layer f's (matched by
position: layers f and f+1 are the same sequence of ops), and everything else (rotary tables, masks,
constants) unchanged; its parameters are declared under `{prefix}.{i}.`. Nodes after the layers read
the last copy's values where they read layer f+1's. Layers f and f+1 must have the same structure
(layer f may compute a few shape values more, which layer f+1 and its copies read: `_paired`);
anything else is refused.
"""

from __future__ import annotations

import difflib

import onnx

from core.errors import ModelError
from planner.graph import module_path

_SCOPES_KEY = "pkg.torch.onnx.name_scopes"
_EXTRA_FIRST_LAYER_NODES = 4  # shape values the first layer may compute for the rest (`_paired`)


def _layer_of(path: str, prefix: str) -> int | None:
    head = prefix + "."
    if not path.startswith(head):
        return None
    index = path[len(head):].split(".", 1)[0]
    return int(index) if index.isdigit() else None


def _copy(node: onnx.NodeProto) -> onnx.NodeProto:
    out = onnx.NodeProto()
    out.CopyFrom(node)
    return out


def _paired(g: onnx.GraphProto, l0: list[int], l1: list[int]) -> list[tuple[int, int]] | None:
    """Layer 0's nodes paired with layer 1's, in order: the same op sequence, or layer 0's with a few
    more nodes that layer 1 does without (a shape the exporter computes once, in the first layer that
    needs it — the token count times top-k of a mixture of experts — and the next layer reads); None
    where they differ otherwise."""
    ops0, ops1 = [g.node[i].op_type for i in l0], [g.node[i].op_type for i in l1]
    if ops0 == ops1:
        return list(zip(l0, l1, strict=True))
    matcher = difflib.SequenceMatcher(a=ops0, b=ops1, autojunk=False)
    pairs = [(l0[b.a + k], l1[b.b + k]) for b in matcher.get_matching_blocks() for k in range(b.size)]
    extra = len(l0) - len(pairs)
    return pairs if len(pairs) == len(l1) and extra <= _EXTRA_FIRST_LAYER_NODES else None


def replicate_layers(model: onnx.ModelProto, prefix: str, num_layers: int, first: int = 0) -> onnx.ModelProto:
    """`model` with layers `{prefix}.0` … `{prefix}.{first + 1}`, deepened to `num_layers` layers by
    repeating the last (layers `first` and `first + 1` the same structure)."""
    g = model.graph
    # Constant nodes are shared between layers (the exporter emits each value once): not repeated.
    layer = [None if n.op_type == "Constant" else _layer_of(module_path(n), prefix) for n in g.node]
    l0 = [i for i, k in enumerate(layer) if k == first]
    l1 = [i for i, k in enumerate(layer) if k == first + 1]
    pairs = _paired(g, l0, l1)
    if not l0 or pairs is None or any(k is not None and k > first + 1 for k in layer):
        raise ModelError(f"cannot repeat the layers under {prefix}: the export's last two layers differ; "
                         "export the model at full depth")
    if num_layers <= first + 2:
        return model
    # Layer 0's values ↔ layer 1's, by position: what layer 1 reads of layer 0, copy c reads of c−1.
    prev_of: dict[str, str] = {}
    for i0, i1 in pairs:
        prev_of.update(zip(g.node[i0].output, g.node[i1].output, strict=True))
    l1_outputs = {t for i in l1 for t in g.node[i].output if t}
    p1 = f"{prefix}.{first + 1}."
    inits = {t.name: t for t in g.initializer}
    infos = {v.name: v for v in g.value_info}

    new_nodes: list[onnx.NodeProto] = [_copy(g.node[i]) for i in range(l1[-1] + 1)]
    rename_prev: dict[str, str] = {t: t for t in l1_outputs}  # layer 1's value → the last copy's
    for c in range(first + 2, num_layers):
        pc = f"{prefix}.{c}."
        here: dict[str, str] = {}
        for i in l1:
            src = g.node[i]
            node = _copy(src)
            node.name = f"{src.name}__L{c}"
            del node.input[:]
            for t in src.input:
                if t in l1_outputs:
                    node.input.append(here[t])
                elif t in prev_of:
                    node.input.append(rename_prev[prev_of[t]])
                elif t.startswith(p1):
                    node.input.append(pc + t[len(p1):])
                else:
                    node.input.append(t)
            del node.output[:]
            for t in src.output:
                here[t] = f"{t}__L{c}" if t else ""
                node.output.append(here[t])
            for p in node.metadata_props:
                if p.key == _SCOPES_KEY:
                    p.value = p.value.replace(f"'{prefix}.{first + 1}", f"'{prefix}.{c}")
            new_nodes.append(node)
        for t, name in here.items():
            if t in infos and name:
                vi = onnx.ValueInfoProto()
                vi.CopyFrom(infos[t])
                vi.name = name
                g.value_info.append(vi)
        rename_prev = {t: here[t] for t in l1_outputs}
        for name, init in list(inits.items()):
            if name.startswith(p1):
                t = onnx.TensorProto()
                t.CopyFrom(init)
                t.name = pc + name[len(p1):]
                g.initializer.append(t)
                if name in infos:
                    vi = onnx.ValueInfoProto()
                    vi.CopyFrom(infos[name])
                    vi.name = t.name
                    g.value_info.append(vi)
    for i in range(l1[-1] + 1, len(g.node)):
        node = _copy(g.node[i])
        for j, t in enumerate(node.input):
            if t in rename_prev:
                node.input[j] = rename_prev[t]
        new_nodes.append(node)
    for out in g.output:
        if out.name in rename_prev:
            out.name = rename_prev[out.name]
    del g.node[:]
    g.node.extend(new_nodes)
    return model
