"""Attention as one kernel, as training frameworks run it — one definition for the cost model and
the executor.

Exporters decompose `scaled_dot_product_attention` into
    MatMul(q, kᵀ) → [Add(mask)] → Softmax(last axis) → [IsNaN → Where(nan, 0, p)] → MatMul(·, v)
(the scale is folded into q and k beforehand). Each such chain is one fused kernel (FlashAttention):
the s×s scores and probabilities never reach memory and backward recomputes them. The cost model
prices exactly these chains so (`memory.attention_score_tensors`), and the executor runs exactly
these as torch's fused SDPA (`executor/interpreter.py`, `executor/spmd.py`); a chain of any other
shape is priced and run op by op.

Runtimes without FlashAttention write the s×s tensors to memory (`--attention`, `ATTENTION_KERNELS`):
"eager" is torch's own ops (transformers' `attn_implementation="eager"`): QKᵀ GEMM, the mask added, a
softmax, dropout, the ·V GEMM, each a kernel reading and writing memory; "fused-softmax" is Megatron-LM's
(apex `FusedScaleMaskSoftmax`, SC'21's runs): the mask and the scale fused into the softmax kernel.
`materialized_kernels` lists their kernels, each priced as a roofline (`kernels_s`);
the exporter's NaN guard (IsNaN → Where) is SDPA's decomposition, not a kernel either runtime runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from core.graph import OpGraph, TensorKind
from core.levers import Attention
from costmodel.device import matmul_time_s

if TYPE_CHECKING:
    from hwprofiles.profile import DeviceSpec

# How the attention chain runs: FlashAttention (scores on chip), torch's eager ops, Megatron-LM's fused
# scale-mask-softmax.
ATTENTION_KERNELS = tuple(Attention)


@dataclass(frozen=True, slots=True)
class AttentionRegion:
    nodes: tuple[str, ...]  # graph order; the last produces the attention output
    q: str
    kt: str  # kᵀ, as the first MatMul reads it
    mask: str | None  # additive, broadcast over heads
    v: str
    out: str
    inputs: tuple[tuple[str, int], ...]  # (node, input index) where q, kᵀ, mask and v enter the chain


def grouped_kv(graph: OpGraph, region: AttentionRegion, depth: int = 8) -> bool:
    """Whether the chain's k reaches it through an Expand within `depth` producers (transformers'
    `repeat_kv`): grouped-query attention, which SDPA runs on its math kernel (the s×s scores in
    memory) where no fused kernel takes the dtype and grouped heads (fp32 on an H100: FlashAttention
    takes bf16/fp16 only, the memory-efficient kernel no grouped heads)."""
    t: str | None = region.kt
    for _ in range(depth):
        name = graph.producer.get(t) if t else None
        if name is None:
            return False
        node = graph.node_by_name[name]
        if node.op_type == "Expand":  # repeat_kv's: more elements out than in (n_rep > 1)
            src = graph.tensors.get(node.inputs[0])
            return src is not None and graph.tensors[node.outputs[0]].numel > src.numel
        floats = [i for i in node.inputs if i in graph.tensors and graph.tensors[i].kind is TensorKind.ACTIVATION]
        t = floats[0] if floats else None  # along the activation (a scale's constant may come first)
    return False


def attention_regions(graph: OpGraph) -> dict[str, AttentionRegion]:
    """Every exporter-decomposed attention in the graph, by the name of its last node."""
    consumers: dict[str, list[Any]] = {}
    for n in graph.compute_nodes:
        for i, t in enumerate(n.inputs):
            if t:
                consumers.setdefault(t, []).append((n, i))
    outputs = set(graph.outputs)

    def only(t: str) -> Any:
        c = consumers.get(t, [])
        return c[0] if len(c) == 1 and t not in outputs else None

    def producer(t: str) -> Any:
        name = graph.producer.get(t)
        return None if name is None or name in graph.constant_nodes else graph.node_by_name[name]

    order = {n.name: i for i, n in enumerate(graph.compute_nodes)}
    out: dict[str, AttentionRegion] = {}
    for sm in graph.compute_nodes:
        if sm.op_type != "Softmax" or not _last_axis(sm, len(graph.tensors[sm.inputs[0]].shape)):
            continue
        nodes, inputs = [sm], []
        src, mask = producer(sm.inputs[0]), None
        if src is not None and src.op_type == "Add" and only(src.outputs[0]):
            add = src
            for i in (0, 1):
                mm = producer(add.inputs[i])
                if mm is not None and mm.op_type == "MatMul" and only(mm.outputs[0]):
                    mask, src = add.inputs[1 - i], mm
                    nodes.insert(0, add)
                    inputs.append((add.name, 1 - i))
                    break
            else:
                continue
        elif src is None or src.op_type != "MatMul" or not only(src.outputs[0]):
            continue
        mm1 = src
        q_info, kt_info = graph.tensors[mm1.inputs[0]], graph.tensors[mm1.inputs[1]]
        if len(q_info.shape) < 3 or len(kt_info.shape) != len(q_info.shape) or not q_info.is_float:
            continue
        if mask is not None and not graph.tensors[mask].is_float:
            continue
        nodes.insert(0, mm1)
        inputs[:0] = [(mm1.name, 0), (mm1.name, 1)]
        # Forward: straight to the ·V MatMul, or through the NaN guard Where(IsNaN(p), 0, p).
        p = sm.outputs[0]
        users = consumers.get(p, [])
        if p in outputs:
            continue
        mm2 = None
        if len(users) == 1 and users[0][0].op_type == "MatMul" and users[0][1] == 0:
            mm2 = users[0][0]
        elif len(users) == 2 and {u.op_type for u, _ in users} == {"IsNaN", "Where"}:
            isnan = next(u for u, _ in users if u.op_type == "IsNaN")
            where = next(u for u, _ in users if u.op_type == "Where")
            nxt = only(where.outputs[0])
            if (only(isnan.outputs[0]) and where.inputs[0] == isnan.outputs[0] and where.inputs[2] == p
                    and _is_zero(graph, where.inputs[1]) and nxt and nxt[0].op_type == "MatMul" and nxt[1] == 0):
                mm2 = nxt[0]
                nodes += [isnan, where]
        if mm2 is None:
            continue
        nodes.append(mm2)
        inputs.append((mm2.name, 1))
        names = tuple(sorted((n.name for n in nodes), key=order.__getitem__))
        if names[-1] != mm2.name:
            continue
        out[mm2.name] = AttentionRegion(nodes=names, q=mm1.inputs[0], kt=mm1.inputs[1], mask=mask, v=mm2.inputs[1],
                                        out=mm2.outputs[0], inputs=tuple(inputs))
    return out


def _last_axis(node: Any, rank: int) -> bool:
    a = int(node.attr("axis", -1))
    return a in (-1, rank - 1)


def _is_zero(graph: OpGraph, t: str) -> bool:
    info = graph.tensors.get(t)
    if info is None or info.kind is not TensorKind.CONSTANT:
        return False
    v = graph.const_values.get(t)
    return v is not None and v.size == 1 and float(v.reshape(-1)[0]) == 0.0


@dataclass(frozen=True, slots=True)
class Kernel:
    """One kernel of a materialised attention: its matmul FLOPs and the bytes it reads and writes."""
    name: str
    flops: float
    bytes: float
    narrow: float = 0.0  # a GEMM's narrowest dim (the head dim), 0 for the others
    op: str = ""  # an element-wise kernel's ONNX op type: priced at that op's rate (`DeviceSpec.elementwise_rate`)


def materialized_kernels(kind: str, *, scores: float, q: float, kv: float, head_dim: float, element_bytes: float,
                         masked: bool, dropout: bool) -> tuple[list[Kernel], list[Kernel], float]:
    """The forward and backward kernels of one attention whose s×s tensors go through memory, and the
    bytes it saves for backward. `scores`: elements of the score tensor (batch × heads × s_q × s_k on
    this rank); `q`: elements of q (and of the output), `kv`: of k (and of v); `element_bytes`: the
    activations' (2 in mixed precision). Forward: QKᵀ writes S, ["eager" with a mask: the mask added,
    S read and written], the softmax reads S and writes P, [dropout reads P, writes the dropped P and
    a one-byte mask], P·V reads it. Backward: dP = dO·Vᵀ writes dP, dV = Pᵀ·dO reads P, [dropout's
    backward: dP and the mask read, dP written], the softmax's backward reads dP and P and writes dS,
    dQ = dS·K and dK = dSᵀ·Q read dS (the mask's add has no backward kernel). Saved: P, and with
    dropout the mask and the dropped P — Korthikanti et al. 2022 §4's 5·a·s²·b bytes per layer in 2-byte
    activations."""
    if kind not in ATTENTION_KERNELS[1:]:
        raise ValueError(f"materialised attention kernels: one of {', '.join(ATTENTION_KERNELS[1:])}, got {kind!r}")
    s, e, mm = scores, element_bytes, 2.0 * scores * head_dim
    fwd = [Kernel("QKᵀ", mm, (q + kv + s) * e, head_dim)]
    if kind == "eager" and masked:
        fwd.append(Kernel("mask add", 0.0, 2 * s * e, op="Add"))
    fwd.append(Kernel("softmax", 0.0, 2 * s * e, op="Softmax"))
    if dropout:
        fwd.append(Kernel("dropout", 0.0, 2 * s * e + s, op="Dropout"))
    fwd.append(Kernel("P·V", mm, (s + kv + q) * e, head_dim))
    bwd = [Kernel("dP = dO·Vᵀ", mm, (q + kv + s) * e, head_dim), Kernel("dV = Pᵀ·dO", mm, (s + q + kv) * e, head_dim)]
    if dropout:
        bwd.append(Kernel("dropout backward", 0.0, 2 * s * e + s, op="Dropout"))
    bwd += [Kernel("softmax backward", 0.0, 3 * s * e, op="Softmax"), Kernel("dQ = dS·K", mm, (s + kv + q) * e, head_dim),
            Kernel("dK = dSᵀ·Q", mm, (s + q + kv) * e, head_dim)]
    saved = s * e + (s + s * e if dropout else 0.0)
    return fwd, bwd, saved


def kernels_s(kernels: list[Kernel], device: DeviceSpec, dtype: str, launch_s: float) -> float:
    """Kernels one after another, each a roofline: its matmul FLOPs at the profile's matmul curve or its
    bytes at memory bandwidth (a GEMM's) or its op type's element-wise bandwidth (the others'),
    whichever is slower, plus a launch."""
    total = 0.0
    for k in kernels:
        bw = device.mem_bandwidth_bytes_per_s if k.flops else device.elementwise_rate(k.op)
        total += max(matmul_time_s(device, k.flops, dtype, k.narrow or None), k.bytes / bw) + launch_s
    return total


# A causal mask compares key positions with query positions (kv ≤ q: transformers' sdpa masks) or
# keeps a triangle (Trilu); a padding mask compares positions with lengths, not these.
_CAUSAL_OPS = frozenset({"Trilu", "LessOrEqual", "Less"})


def causal_regions(graph: OpGraph) -> frozenset[str]:
    """The attention chains (by last node) whose mask is causal, read off the ops that build the mask."""
    producer = {t: n for n in graph.nodes for t in n.outputs if t}
    out = set()
    for last, region in attention_regions(graph).items():
        seen: set[str] = set()
        stack = [region.mask] if region.mask else []
        while stack:
            t = stack.pop()
            if t in seen or t not in producer:
                continue
            seen.add(t)
            node = producer[t]
            if node.op_type in _CAUSAL_OPS:
                out.add(last)
                break
            stack.extend(x for x in node.inputs if x)
    return frozenset(out)
