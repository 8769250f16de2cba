"""Which tensors of an ONNX file are the torch module's trainable parameters, whatever exported it.

Part of the import stage (`planner/graph.py` calls `find_parameters`). A parameter is what the torch
module trains; the evidence, strongest first:

1. The torch exporter's metadata: `InputSpec.kind` on an initializer (PARAMETER, BUFFER, CONSTANT…).
2. onnxscript's optimizer (`torch.onnx.export(..., dynamo=True)` runs it by default) folds constant
   subgraphs and records `folded_from` on the result. A weight's folded `Transpose` (renamed `val_NN`)
   is that weight, transposed: a parameter, counted once. A tensor folded from module state through
   selection and layout ops only (a position table gathered at the export's static positions, a
   class token expanded to its static batch) is a parameter at its folded shape, flagged `STATIC`:
   planning prices it, `run` refuses it (the torch module trains the whole table, not the rows the
   export read). Module state folded through arithmetic (rotary cos/sin tables from `inv_freq`, masks)
   is a constant.
3. Without metadata (other exporters, hand-written recipes): float initializers with more than one
   element that reach a differentiable input of a compute op (through views and casts), excluding
   normalisation statistics and the shape/scale operands of ops (`Resize` scales, `Reshape` shapes).

The optimizer also merges initializers with equal values (deduplication): in a freshly initialised
model every bias is zero and every norm scale one, so one initializer stands for dozens of distinct
parameters. The exporter's `fx_node` metadata on each node names the module parameters the torch op
read (`%p_model_layers_0_q_proj_bias`); where the uses of one initializer stand for several of them,
the initializer is split back into one parameter per torch parameter (same value, new names).
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import onnx
import onnx.numpy_helper

from core.errors import ModelError
from core.graph import Fold, Init, Parameter

KIND_KEY = "pkg.torch.export.graph_signature.InputSpec.kind"
_ORIGINAL_NAME_KEY = "pkg.torch.onnx.original_node_name"
_FOLDED_KEY = "pkg.onnxscript.optimizer.folded_from"
_FX_NODE_KEY = "pkg.torch.onnx.fx_node"
_WEIGHT_KINDS = frozenset({"PARAMETER", "BUFFER"})

_FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
                          onnx.TensorProto.DOUBLE})
# Inputs through which no gradient flows: running statistics, and the shape, index and scale operands.
NON_DIFFERENTIABLE_INPUTS: dict[str, tuple[int, ...]] = {
    "BatchNormalization": (3, 4), "Reshape": (1,), "Expand": (1,), "Tile": (1,), "Slice": (1, 2, 3, 4),
    "Gather": (1,), "GatherElements": (1,), "GatherND": (1,), "Resize": (1, 2, 3), "Upsample": (1,),
    "Pad": (1, 2, 3), "Dropout": (1, 2), "Clip": (1, 2), "ConstantOfShape": (0,), "Range": (0, 1, 2),
    "Where": (0,), "Squeeze": (1,), "Unsqueeze": (1,), "Split": (1,), "ReduceMean": (1,), "ReduceSum": (1,),
    "ReduceMax": (1,), "ReduceMin": (1,), "TopK": (1,), "OneHot": (0, 1), "CastLike": (1,), "Shape": (0,),
    "Size": (0,), "ScatterND": (1,), "ScatterElements": (1,), "Trilu": (1,),
}
# Ops a weight passes through as views, casts or selections of itself (a position table gathered at
# constant positions, a class token expanded over the batch): its gradient path goes on.
_PASS_THROUGH = frozenset({"Transpose", "Reshape", "Cast", "Identity", "Unsqueeze", "Squeeze", "Flatten", "Expand",
                           "Tile", "Gather", "Slice", "Concat", "Split"})
# Exporter value names of ops that select or re-lay out their input (fx names an op's output after
# it: "slice_1", "embedding_2"), and the integer arithmetic of position indices (arange + offset); a
# fold through anything else (mul, cos, pow…) computed new values from the state.
_SELECTION_OPS = frozenset({"add", "sub", "slice", "select", "embedding", "index", "expand", "view", "reshape", "transpose",
                            "permute", "t", "unsqueeze", "squeeze", "clone", "contiguous", "alias", "detach",
                            "_to_copy", "to", "arange", "_unsafe_view", "flatten", "lift_fresh_copy"})
_VAL_NAME = re.compile(r"^val_\d+$")
# Ops the TorchScript exporter folds BatchNormalization into, writing the result as `onnx::Conv_NN`.
_FUSED_INTO = frozenset({"Conv", "ConvTranspose"})
_FX_PARAMS = re.compile(r"%(p_\w+)")


@dataclass(frozen=True, slots=True)
class ParameterTable:
    params: dict[str, Parameter]
    # (node index, input index) → the parameter that input reads, where a merged initializer was split
    renamed_inputs: dict[tuple[int, int], str]
    dropped_biases: tuple[DroppedBias, ...]
    notes: tuple[str, ...]


def normalize(name: str) -> str:
    """Compare names across torch's spellings: "model.LayerNorm.weight", "p_model_layernorm_weight"."""
    return re.sub(r"\W", "_", name.lower())


def _placeholder_key(name: str) -> str:
    return normalize(name[2:] if name.startswith(("p_", "b_", "c_")) else name)


def value_metadata(g: onnx.GraphProto) -> dict[str, dict[str, str]]:
    return {v.name: {p.key: p.value for p in v.metadata_props}
            for v in (*g.input, *g.value_info) if len(v.metadata_props)}


def find_parameters(g: onnx.GraphProto) -> ParameterTable:
    meta = value_metadata(g)
    inits = {t.name: t for t in g.initializer}
    _reject_undeclared_weights(g, meta, inits)
    consumers = _consumers(g)
    data = _data_tensors(g, inits)
    exporter_kinds = any(KIND_KEY in meta.get(n, {}) for n in inits)
    fx_params = {_placeholder_key(p) for n in g.node for v in _fx_texts(n) for p in _FX_PARAMS.findall(v)}
    known_params = fx_params | {_placeholder_key(meta[n].get(_ORIGINAL_NAME_KEY, n)) for n in inits
                                if meta.get(n, {}).get(KIND_KEY) == "PARAMETER"}

    params: dict[str, Parameter] = {}
    static: list[str] = []
    for name, init in inits.items():
        md = meta.get(name, {})
        kind = md.get(KIND_KEY)
        if init.data_type not in _FLOAT_TYPES:
            continue
        if kind is not None:
            if kind == "PARAMETER":
                params[name] = Parameter(name, name, name)
            continue
        folded = _folded_from(md)
        if folded is not None:
            p = _folded_parameter(name, folded, known_params)
            if p is not None:
                params[name] = p
                if p.fold is Fold.STATIC:
                    static.append(f"{name} ← {p.origin}")
            continue
        if exporter_kinds:
            continue  # the exporter declared every parameter it lifted; the rest it made itself
        numel = int(np.prod(init.dims))
        if numel > 1 and _reaches_gradient(name, consumers, data):
            params[name] = Parameter(name, name, "")
    if not exporter_kinds:
        for name in _declared_by_shape(g, inits, consumers, data):
            params[name] = Parameter(name, "", "", init=Init.SEEDED)

    renamed, dropped, fx_notes = _match_fx_uses(g, params, meta)
    for (i, j), new in renamed.items():
        params.setdefault(new, Parameter(new, params[g.node[i].input[j]].source, new))
    for d in dropped:
        params[d.name] = Parameter(d.name, "", d.name, init=Init.ZEROS)
    notes = list(fx_notes)
    rewritten = sorted(n for n in params if n.startswith("onnx::") and n.removeprefix("onnx::").split("_")[0] in _FUSED_INTO)
    if rewritten and not exporter_kinds:
        notes.append(f"{len(rewritten)} weight(s) were rewritten by the TorchScript exporter's constant folding "
                     f"({', '.join(rewritten[:3])}{', …' if len(rewritten) > 3 else ''}: BatchNormalization folded into "
                     "Conv in eval mode): the module's normalisation parameters are not in the file — export "
                     "with do_constant_folding=False or training=torch.onnx.TrainingMode.TRAINING to plan them")
    if static:
        notes.append(f"{len(static)} parameter(s) were folded at the export's static shapes ({', '.join(static)}): "
                     "planned and trained as the rows the export read; the torch module's tensors are larger — "
                     "export with dynamic_shapes or optimize=False to plan and train them whole")
    return ParameterTable(params, renamed, tuple(dropped), tuple(notes))


def _declared_by_shape(g: onnx.GraphProto, inits: dict[str, onnx.TensorProto],
                       consumers: dict[str, list[tuple[onnx.NodeProto, int]]], data: set[str]) -> list[str]:
    """Weights written as `ConstantOfShape(dims)` (the ONNX test data's "light" model-zoo files, a
    shape-only recipe): a float fill of more than one element that reaches a differentiable input."""
    out = []
    for n in g.node:
        if n.op_type != "ConstantOfShape" or not n.input or n.input[0] not in inits:
            continue
        value = next((a.t for a in n.attribute if a.name == "value"), None)
        if value is not None and value.data_type not in _FLOAT_TYPES:
            continue
        dims = onnx.numpy_helper.to_array(inits[n.input[0]]) if inits[n.input[0]].data_location != \
            onnx.TensorProto.EXTERNAL else np.zeros(0)
        if dims.size and int(np.prod(dims)) > 1 and _reaches_gradient(n.output[0], consumers, data):
            out.append(n.output[0])
    return out


def _fx_texts(node: onnx.NodeProto) -> list[str]:
    return [p.value for p in node.metadata_props if p.key == _FX_NODE_KEY]


def _folded_from(md: dict[str, str]) -> list[str] | None:
    raw = md.get(_FOLDED_KEY)
    if raw is None:
        return None
    try:
        names = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return None
    return [str(n) for n in names] if isinstance(names, list | tuple) else None


def _folded_parameter(name: str, folded: list[str], known_params: set[str]) -> Parameter | None:
    state = [n for n in folded if "." in n]  # module state keeps its dotted FQN; computed values do not
    if not state:
        return None
    ops = {re.sub(r"_\d+$", "", n) for n in folded if "." not in n and not _VAL_NAME.match(n)}
    if len(folded) == 1:  # one piece of module state, nothing else: a re-layout of one weight
        return Parameter(name, name, state[0], Fold.LAYOUT)  # one weight, re-laid out (a transpose)
    if ops <= _SELECTION_OPS:
        trained = [s for s in state if _placeholder_key(s) in known_params] or state
        return Parameter(name, name, trained[0], Fold.STATIC)
    return None  # arithmetic on module state: a computed table (rotary cos/sin from inv_freq)


def _consumers(g: onnx.GraphProto) -> dict[str, list[tuple[onnx.NodeProto, int]]]:
    out: dict[str, list[tuple[onnx.NodeProto, int]]] = defaultdict(list)
    for n in g.node:
        for i, t in enumerate(n.input):
            if t:
                out[t].append((n, i))
    return out


def _data_tensors(g: onnx.GraphProto, inits: dict[str, onnx.TensorProto]) -> set[str]:
    """Tensors that depend on the data: computed from a graph input other than through Shape/Size
    (whose values are known once dims are bound)."""
    data = {v.name for v in g.input if v.name not in inits}
    for n in g.node:  # topological order
        if n.op_type not in ("Shape", "Size") and any(t in data for t in n.input):
            data.update(o for o in n.output if o)
    return data


def _reaches_gradient(name: str, consumers: dict[str, list[tuple[onnx.NodeProto, int]]], data: set[str]) -> bool:
    """A weight meets the data in a differentiable input of an op, after views, casts and selections
    only. A float constant first combined with other constants (rotary tables from `inv_freq`, masks
    from ranges) computes a table: module state, not a trained weight."""
    stack, seen = [name], {name}
    while stack:
        t = stack.pop()
        for node, i in consumers.get(t, []):
            if i in NON_DIFFERENTIABLE_INPUTS.get(node.op_type, ()):
                continue
            if any(u in data for j, u in enumerate(node.input) if j != i):
                return True
            if node.op_type in _PASS_THROUGH:
                for o in node.output:
                    if o and o not in seen:
                        seen.add(o)
                        stack.append(o)
    return False


def _reject_undeclared_weights(g: onnx.GraphProto, meta: dict[str, dict[str, str]],
                               inits: dict[str, onnx.TensorProto]) -> None:
    """Weights saved without their declarations (`ONNXProgram.save(include_initializers=False)`)
    are names the nodes read that nothing defines, or inputs the exporter marked as weights."""
    defined = set(inits) | {v.name for v in g.input} | {o for n in g.node for o in n.output}
    dangling = list(dict.fromkeys(t for n in g.node for t in n.input if t and t not in defined))
    weights = dangling + [v.name for v in g.input
                          if v.name not in inits and meta.get(v.name, {}).get(KIND_KEY) in _WEIGHT_KINDS]
    if weights:
        shown = ", ".join(weights[:3]) + (", …" if len(weights) > 3 else "")
        raise ModelError(
            f"{len(weights)} weight inputs have no declaration: {shown} (saved with include_initializers=False?); "
            "re-save with include_initializers=True, or write a shape-only file with `meshplan export`")


# Torch ops whose zero bias the optimizer removes (an Add of zeros, Gemm's C), and where their bias
# argument stands among the op's parameter arguments.
_BIAS_ARG = {"linear": -1, "addmm": 0, "convolution": -1, "conv1d": -1, "conv2d": -1, "conv3d": -1}
_FX_HEAD = re.compile(r"%(\w+) : .*?target=torch\.ops\.aten\.(\w+)\.")


@dataclass(frozen=True, slots=True)
class DroppedBias:
    """A torch op's bias that the file lacks: the optimizer removed it because it was all zeros."""

    node_index: int  # the ONNX node producing the torch op's output
    name: str  # the parameter, named after the torch placeholder
    conv: bool  # Conv's bias slot (channels, dim 1); else added along the last dim


def _match_fx_uses(g: onnx.GraphProto, params: dict[str, Parameter], meta: dict[str, dict[str, str]]
                   ) -> tuple[dict[tuple[int, int], str], list[DroppedBias], list[str]]:
    """Map each use of a parameter initializer to the torch parameter it stands for.

    Nodes are grouped by the torch op they were exported from (`fx_node`); each group's torch op
    read some parameters (its `%p_…` arguments). A use whose initializer stands for one of them is
    matched; the remaining uses are matched with the remaining arguments in order (both follow the
    op's signature: weight before bias). A use standing for another parameter than its initializer
    (a merged initializer) reads a parameter of its own. A bias argument no use stands for was
    dropped by the optimizer (its value was zero) and is restored."""
    origin = {n: _placeholder_key(meta.get(n, {}).get(_ORIGINAL_NAME_KEY, p.origin or n))
              for n, p in params.items()}
    groups: dict[str, list[int]] = defaultdict(list)
    for i, node in enumerate(g.node):
        texts = _fx_texts(node)
        if texts:
            groups[texts[0]].append(i)
    stands_for: dict[tuple[int, int], str] = {}
    dropped: list[DroppedBias] = []
    for text, nodes in groups.items():
        head = _FX_HEAD.match(text)
        args = list(dict.fromkeys(_placeholder_key(p) for p in _FX_PARAMS.findall(text.split("=", 1)[-1])))
        uses = [(i, j) for i in nodes for j, t in enumerate(g.node[i].input) if t in params]
        taken = {origin[g.node[i].input[j]] for i, j in uses} & set(args)
        rest = [u for u in uses if origin[g.node[u[0]].input[u[1]]] not in args]
        free = [a for a in args if a not in taken]
        if rest and len(rest) == len(free):
            stands_for.update(zip(rest, free, strict=True))
        elif not rest and len(free) == 1 and head and head.group(2) in _BIAS_ARG \
                and len(args) == 2 and free[0] == args[_BIAS_ARG[head.group(2)]]:
            out = [i for i in nodes if head.group(1) in g.node[i].output]
            if out:
                dropped.append(DroppedBias(out[0], free[0], conv=head.group(2).startswith("conv")))
    renamed: dict[tuple[int, int], str] = {}
    split: dict[str, set[str]] = defaultdict(set)
    for (i, j), key in stands_for.items():
        init = g.node[i].input[j]
        if key != origin[init]:
            renamed[(i, j)] = _unique_name(key, params)
            split[init].add(key)
    notes = []
    if split:
        n = sum(len(v) for v in split.values())
        notes.append(f"{n} parameter(s) merged by the exporter's optimizer (equal initial values) were split "
                     f"back from {len(split)} initializer(s), as the torch module holds them")
    if dropped:
        notes.append(f"{len(dropped)} zero bias(es) removed by the exporter's optimizer were restored "
                     f"({', '.join(d.name for d in dropped[:3])}{', …' if len(dropped) > 3 else ''})")
    return renamed, dropped, notes


def _unique_name(key: str, params: dict[str, Parameter]) -> str:
    return key if key not in params else f"{key}__split"
