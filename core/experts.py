"""Mixture-of-experts blocks found in an imported graph: the router, its top-k, the routed experts'
weights and the shared experts beside them, recognised from the ops any exporter writes for one.

A block is a TopK whose indices select rows of expert weights: some Gather (GatherND, Gather) reads a
parameter of three or more dims — the experts stacked on its first dim, `[E, …]`, as transformers'
experts modules, torchtitan's `GroupedExperts` and Megatron's grouped GEMM hold them — at indices that
depend on the TopK's. The router is the parameter(s) on the path from the matmul into the TopK's scores
(the gate's weight, DeepSeek-V3's score-correction bias); the block is the module both sit in (their
module paths' common prefix), and the shared experts are the other parameters its nodes read (DeepSeek-V3,
Qwen2-MoE). Token counts per expert are data-dependent; the planner binds them by an assumption, uniform
routing times a capacity factor (`CAPACITY_FACTOR`), stated wherever a figure depends on it."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from core.graph import OpGraph, TensorKind
from core.mesh import DeviceMesh

CAPACITY_FACTOR = 1.25  # tokens an expert is sized for: the uniform share times this (GShard, Switch)
# Ops whose output is their first input's values (rearranged or cast): traced through to a parameter.
_VIEWS = frozenset({"Transpose", "Reshape", "Identity", "Cast", "CastLike", "Unsqueeze", "Squeeze", "Flatten",
                    "Expand", "Slice", "Split", "Concat"})
EP_AXIS = "ep"  # the mesh axis expert parallelism splits the experts over
EXPERT_PARALLEL = "expert_parallel"  # an expert gather's kernel there: tokens sent to their experts' ranks
_GATHERS = frozenset({"Gather", "GatherND", "GatherElements"})
_ROUTER_DEPTH = 12  # nodes walked back from the TopK's scores to find the router's matmul


@dataclass(frozen=True, slots=True)
class ExpertBlock:
    """One mixture-of-experts block of the graph."""

    module: str  # the block's module path ("model.layers.0.mlp"); "" where the exporter wrote none
    topk: str  # the TopK node
    top_k: int  # experts per token
    num_experts: int  # routed experts (the first dim of their weights)
    router: tuple[str, ...]  # the router's parameters
    experts: tuple[str, ...]  # the routed experts' parameters, `[num_experts, …]`
    shared: tuple[str, ...]  # the shared experts' parameters (every token runs them)
    gathers: tuple[str, ...] = ()  # the nodes gathering each routed slot's expert weights


def find_expert_blocks(graph: OpGraph) -> tuple[ExpertBlock, ...]:
    """Every mixture-of-experts block, in the graph's order."""
    if not any(n.op_type == "TopK" for n in graph.compute_nodes):
        return ()
    readers: dict[str, list[str]] = defaultdict(list)
    for n in graph.compute_nodes:
        for t in n.inputs:
            if t:
                readers[t].append(n.name)
    out = []
    for node in graph.compute_nodes:
        if node.op_type != "TopK" or len(node.outputs) < 2:
            continue
        k = graph.constant_value(node.inputs[1]) if len(node.inputs) > 1 else None
        if k is None or k.size != 1:
            continue
        routed = _reached(graph, node.outputs[1], readers)
        experts: set[str] = set()
        expert_nodes: list[str] = []
        for n in graph.compute_nodes:
            if n.op_type in _GATHERS and len(n.inputs) > 1 and n.inputs[1] in routed:
                p = _param_of(graph, n.inputs[0])
                if p is not None and len(graph.tensors[p].shape) >= 3:
                    experts.add(p)
                    expert_nodes.append(n.name)
        if not experts:
            continue
        sizes = {graph.tensors[p].shape[0] for p in experts}
        if len(sizes) != 1:
            continue
        router = _router(graph, node.inputs[0])
        module = _common_path([node.module_path, *(graph.node_by_name[n].module_path for n in expert_nodes)])
        taken = experts | set(router)
        shared = sorted({t for n in graph.compute_nodes if module and n.module_path.startswith(module + ".")
                         for t in n.inputs if t and (p := _param_of(graph, t)) is not None and p == t
                         and t not in taken}) if module else []
        out.append(ExpertBlock(module=module, topk=node.name, top_k=int(k.reshape(-1)[0]), num_experts=sizes.pop(),
                               router=tuple(sorted(router)), experts=tuple(sorted(experts)), shared=tuple(shared),
                               gathers=tuple(expert_nodes)))
    return tuple(out)


def expert_matmuls(graph: OpGraph, block: ExpertBlock) -> tuple[dict[str, int], frozenset[str]]:
    """A block's expert matmuls — each matmul reading gathered expert weights (through views) → the
    index of that operand — and the gathers and views between the weights and them."""
    readers: dict[str, list[str]] = defaultdict(list)
    for n in graph.compute_nodes:
        for t in n.inputs:
            if t:
                readers[t].append(n.name)
    matmuls: dict[str, int] = {}
    chain: set[str] = set()
    for g in block.gathers:
        todo = [g]
        while todo:
            name = todo.pop()
            chain.add(name)
            for t in graph.node_by_name[name].outputs:
                for r in readers.get(t, ()):
                    node = graph.node_by_name[r]
                    if node.op_type in ("MatMul", "Gemm"):
                        matmuls[r] = node.inputs.index(t)
                    elif node.op_type in _VIEWS and node.inputs[0] == t:
                        todo.append(r)
    return matmuls, frozenset(chain)


def expert_weight_nodes(graph: OpGraph, block: ExpertBlock) -> frozenset[str]:
    """A block's expert gathers and the views between its experts' parameters and them (a transpose or
    cast of the stacked weights): the nodes that hold the experts split under expert parallelism."""
    out = set(block.gathers)
    for g in block.gathers:
        t = graph.node_by_name[g].inputs[0]
        for _ in range(16):
            src = graph.producer.get(t)
            node = graph.node_by_name.get(src) if src is not None else None
            if node is None or node.op_type not in _VIEWS or not node.inputs:
                break
            out.add(node.name)
            t = node.inputs[0]
    return frozenset(out)


@dataclass(frozen=True, slots=True)
class ExpertRegion:
    """What a block's experts compute on each routed slot: the nodes from its expert gathers to its last
    expert matmul (in graph order; every one row-wise over the slots), the inputs they read from outside
    (node, input index) — the gathered weights, the slots' expert ids (`ids`), the slots' tokens
    (`rows`) and constants — and the one tensor they hand back, a row per slot."""

    block: ExpertBlock
    nodes: tuple[str, ...]
    inputs: tuple[tuple[str, int], ...]
    ids: tuple[tuple[str, int], ...]
    rows: tuple[tuple[str, int], ...]
    output: str


def expert_region(graph: OpGraph, block: ExpertBlock) -> ExpertRegion | None:
    """The block's region (`ExpertRegion`), or None where its nodes hand back more than one tensor or
    read a row input that is not one row per slot."""
    matmuls, _ = expert_matmuls(graph, block)
    if not matmuls or not block.gathers:
        return None
    order = {n.name: i for i, n in enumerate(graph.compute_nodes)}
    last = max(matmuls, key=order.__getitem__)
    readers: dict[str, list[str]] = defaultdict(list)
    for n in graph.compute_nodes:
        for t in n.inputs:
            if t:
                readers[t].append(n.name)
    after: set[str] = set()
    todo = list(block.gathers)
    while todo:
        x = todo.pop()
        if x not in after:
            after.add(x)
            todo += [r for t in graph.node_by_name[x].outputs if t for r in readers.get(t, ())]
    before: set[str] = set()
    todo = [last]
    while todo:
        x = todo.pop()
        if x not in before:
            before.add(x)
            todo += [p for t in graph.node_by_name[x].inputs if t and (p := graph.producer.get(t)) is not None]
    inside = after & before
    nodes = tuple(sorted(inside, key=order.__getitem__))
    made = {t for n in nodes for t in graph.node_by_name[n].outputs if t}
    handed = {t for t in made if any(r not in inside for r in readers.get(t, ()))} | (made & set(graph.outputs))
    out = graph.node_by_name[last].outputs[0]
    if handed != {out}:
        return None
    slots = graph.tensors[out].shape[0]
    inputs: list[tuple[str, int]] = []
    ids: list[tuple[str, int]] = []
    rows: list[tuple[str, int]] = []
    for name in nodes:
        for i, t in enumerate(graph.node_by_name[name].inputs):
            if not t or t in made:
                continue
            inputs.append((name, i))
            if name in block.gathers:
                if i == 1:
                    ids.append((name, i))
            elif graph.tensors[t].kind is not TensorKind.CONSTANT:
                if not graph.tensors[t].shape or graph.tensors[t].shape[0] != slots:
                    return None
                rows.append((name, i))
    return ExpertRegion(block, nodes, tuple(inputs), tuple(ids), tuple(rows), out)


def active_params(graph: OpGraph, blocks: tuple[ExpertBlock, ...]) -> int:
    """Parameters one token runs through: all but the routed experts' share it does not visit (each
    block's experts × (1 − top_k / num_experts))."""
    idle = sum(graph.tensors[p].numel * (b.num_experts - b.top_k) / b.num_experts for b in blocks for p in b.experts)
    return round(graph.num_params - idle)


def _reached(graph: OpGraph, start: str, readers: Mapping[str, list[str]]) -> set[str]:
    """The integer tensors computed from `start` (itself included): the indices it becomes (not the
    activations the experts' outputs flow into, which reach every later block)."""
    seen = {start}
    todo = [start]
    while todo:
        for n in readers.get(todo.pop(), ()):
            for t in graph.node_by_name[n].outputs:
                if t and t not in seen and (info := graph.tensors.get(t)) is not None and not info.is_float:
                    seen.add(t)
                    todo.append(t)
    return seen


def _param_of(graph: OpGraph, tensor: str) -> str | None:
    """The parameter `tensor` is (a view or cast of), or None."""
    for _ in range(16):
        info = graph.tensors.get(tensor)
        if info is None:
            return None
        if info.kind is TensorKind.PARAM:
            return tensor
        src = graph.producer.get(tensor)
        node = graph.node_by_name.get(src) if src is not None else None
        if node is None or node.op_type not in _VIEWS or not node.inputs:
            return None
        tensor = node.inputs[0]
    return None


def _router(graph: OpGraph, scores: str) -> list[str]:
    """The parameters on the way into the TopK's scores, back to (and including) the first matmul's."""
    found: list[str] = []
    todo, seen = [scores], {scores}
    for _ in range(_ROUTER_DEPTH):
        if not todo:
            break
        t = todo.pop(0)
        src = graph.producer.get(t)
        node = graph.node_by_name.get(src) if src is not None else None
        if node is None:
            continue
        params = [p for x in node.inputs if x and (p := _param_of(graph, x)) is not None]
        found += [p for p in params if p not in found]
        if node.op_type in ("MatMul", "Gemm") and params:
            break
        for x in node.inputs:
            if x and x not in seen and graph.tensors.get(x) is not None and graph.tensors[x].kind is TensorKind.ACTIVATION:
                seen.add(x)
                todo.append(x)
    return found


def _common_path(paths: list[str]) -> str:
    parts = [p.split(".") for p in paths if p]
    if not parts:
        return ""
    common = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def expert_dim(graph: OpGraph, gather: str) -> int:
    """The dim of a gather's data that holds the experts (Gather's axis, GatherND's first indexed dim)."""
    node = graph.node_by_name[gather]
    return int(node.attr("axis" if node.op_type == "Gather" else "batch_dims", 0))  # type: ignore[call-overload]


def splits_over(graph: OpGraph, block: ExpertBlock, ep: int) -> bool:
    """Whether expert parallelism over `ep` ranks can split the block: every one of its gathers a Gather or
    a one-index GatherND whose data holds the experts on that dim, `ep` dividing them. All of a block's
    gathers split, or none (the executor runs a block's experts where they are, or all here)."""
    if ep < 2 or block.num_experts % ep or not block.gathers:
        return False
    for g in block.gathers:
        node = graph.node_by_name[g]
        data = graph.tensors[node.inputs[0]].shape
        d = expert_dim(graph, g)
        if node.op_type not in ("Gather", "GatherND") or len(data) <= d or data[d] != block.num_experts:
            return False
        if node.op_type == "GatherND" and (graph.tensors[node.inputs[1]].shape or (0,))[-1] != 1:
            return False
    return True


def ep_axis(mesh: DeviceMesh) -> int | None:
    """The mesh's expert-parallel axis (named `ep`, more than one rank), or None."""
    if EP_AXIS not in mesh.axis_names:
        return None
    a = mesh.axis_names.index(EP_AXIS)
    return a if mesh.shape[a] > 1 else None
