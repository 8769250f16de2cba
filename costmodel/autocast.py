"""What `torch.autocast(dtype=torch.bfloat16)` does to a graph exported in fp32: each float tensor's
dtype as the ops run, and the casts autocast inserts (PyTorch's autocast op lists,
torch/csrc/autograd/autocast_mode.cpp and the AMP docs' "Ops that can autocast": CUDA's on a GPU,
the CPU's on a CPU, whose fp32 list holds the losses but not softmax, layer norm, pow or exp).

- Matmul-class ops (MatMul, Gemm, Conv, attention) run in bf16: each fp32 input is cast to bf16 first,
  a kernel of its own (a weight's cast is cached for the forward: once per micro-batch), and backward
  casts the gradient of each such input back to fp32.
- Ops autocast runs in fp32 (on CUDA softmax, log-softmax, layer norm, pow, exp, log, reciprocal,
  sums; the losses on both): fp32 outputs.
- Every other op runs in the widest float dtype of its dimensioned inputs, parameters (fp32 master
  weights) included — a scalar (0-d) does not promote: the residual stream, which starts at the fp32
  embedding, stays fp32.
- A bias added to a matmul's output alone is the matmul's epilogue (`F.linear`'s addmm): bf16.

Exporters fold nothing of this into an fp32 graph, so the cost model derives it here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from core.graph import OpGraph, OpNode, TensorKind
from costmodel.attention import attention_regions
from costmodel.memory import Precision

LOW_OPS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum"})
LOSSES = frozenset({"SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"})
FP32_OPS = {"cuda": frozenset({"Softmax", "LogSoftmax", "LayerNormalization", "Pow", "Exp", "Log", "Reciprocal",
                               "ReduceSum", "CumSum", "ReduceLogSumExp", "ReduceProd"}) | LOSSES,
            "cpu": frozenset({"ReduceProd"}) | LOSSES}
LOW, FULL = 2, 4  # bytes of bf16 and fp32


def for_graph(precision: Precision, graph: OpGraph, device: str = "cuda") -> Precision:
    """`precision` with each float tensor's bytes as autocast on `device` ("cuda" or "cpu") runs
    `graph` (an autocast precision); with the weights' casts (FSDP's mixed precision); else as it is."""
    if precision.param_casts:  # each weight cast to bf16 for its first user, its gradient back
        first: dict[str, list[str]] = {}
        seen: set[str] = set()
        for n in graph.compute_nodes:
            for t in n.inputs:
                if t in graph.tensors and graph.tensors[t].kind is TensorKind.PARAM and graph.tensors[t].is_float \
                        and t not in seen:
                    seen.add(t)
                    first.setdefault(n.name, []).append(t)
        return replace(precision, cast_inputs={n: tuple(ps) for n, ps in first.items()})
    if not precision.autocast:
        return precision
    sizes = dtypes(graph, device)
    return replace(precision, float_bytes=sizes, cast_inputs=cast_inputs(graph, sizes))


def dtypes(graph: OpGraph, device: str = "cuda") -> dict[str, int]:
    """Each float tensor's bytes under autocast on `device`."""
    fp32_ops = FP32_OPS[device]
    out: dict[str, int] = {t.name: FULL for t in graph.tensors.values() if t.is_float
                           and t.kind in (TensorKind.PARAM, TensorKind.INPUT, TensorKind.CONSTANT)}
    in_attention = {n for r in attention_regions(graph).values() for n in r.nodes}
    producer = {t: n for n in graph.compute_nodes for t in n.outputs if t}
    readers: dict[str, int] = {}
    for n in graph.compute_nodes:
        for t in n.inputs:
            if t:
                readers[t] = readers.get(t, 0) + 1
    for n in graph.compute_nodes:
        floats = [out.get(t, FULL) for t in n.inputs if t and t in graph.tensors and graph.tensors[t].is_float
                  and graph.tensors[t].shape]
        if n.op_type in LOW_OPS or n.name in in_attention:
            size = LOW
        elif n.op_type in fp32_ops:
            size = FULL
        elif n.op_type == "Add" and _bias_epilogue(graph, n.inputs, producer, readers):
            size = LOW
        else:
            size = max(floats, default=FULL)
        for t in n.outputs:
            if t and t in graph.tensors and graph.tensors[t].is_float:
                out[t] = size
    return out


def cast_inputs(graph: OpGraph, sizes: Mapping[str, int]) -> dict[str, tuple[str, ...]]:
    """Node → its float inputs autocast casts to bf16 before running it: a matmul's fp32 ones, and an
    attention chain's fp32 q, k and v (at its last node). `sizes`: the tensors' bytes (`dtypes`)."""

    def fp32(tensors: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(t for t in tensors if t and t in graph.tensors and graph.tensors[t].is_float
                     and sizes.get(t, FULL) == FULL)

    regions = attention_regions(graph).values()
    in_attention = {n for r in regions for n in r.nodes}
    out = {n.name: fp32(n.inputs) for n in graph.compute_nodes if n.op_type in LOW_OPS and n.name not in in_attention}
    out.update({r.nodes[-1]: fp32((r.q, r.kt, r.v)) for r in regions})  # SDPA's q, k and v, at its last node
    return {n: ts for n, ts in out.items() if ts}


def _bias_epilogue(graph: OpGraph, inputs: tuple[str, ...], producer: Mapping[str, OpNode],
                   readers: Mapping[str, int]) -> bool:
    """An Add of a matmul's output (read by it alone) and a 1-d parameter: `F.linear`'s bias."""
    if len(inputs) != 2:
        return False
    a, b = (graph.tensors.get(t) if t else None for t in inputs)
    for x, bias in ((a, b), (b, a)):
        if x is None or bias is None or bias.kind is not TensorKind.PARAM or len(bias.shape) != 1:
            continue
        p = producer.get(x.name)
        if p is not None and p.op_type in ("MatMul", "Gemm") and readers.get(x.name) == 1:
            return True
    return False
