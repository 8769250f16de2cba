"""Compute time of one op on one rank: a roofline on the rank's local shard.

Forward: matmul-class FLOPs at the profile's peak for the dtype times the efficiency curve for that
matmul size (a convolution also no faster than its channel count allows, where the profile says);
every op also moves its inputs and outputs through memory; time = max(FLOP time, byte time) + the
per-op overhead (the profile's graph-op overhead: the kernel launch, plus on a CPU the executor's
interpreter and autograd work). Backward: a matmul is two matmuls (input and weight gradients), 2×
the forward FLOPs, or one where an operand needs no gradient (a graph input); on a device the host
launches ahead of (a GPU: the profile's `async_launch`), an op costs the longer of its work and its
launches and a view nothing. A memory-bound op runs
torch's gradient kernels for it, at its op type's calibrated backward rate where the profile has one
(a tanh's backward is a multiply-add on its output, a fifth of the forward's time on a CPU core; a
pow's a pow and two multiplies, 5×), else ≈ 2× the forward bytes (they read the output gradient and
the saved inputs and write the input gradients). Views (Reshape, Transpose, …) move nothing: launch only.
Element-wise kernels run at the profile's element-wise bandwidth for their op type (calibrated on
CPUs, where it is far below a copy's and differs by op: an erf runs at half an add's rate), else the
calibrated mix's. Attention's score chain is one fused kernel (FlashAttention): its s×s tensors
stay on chip, so they cost FLOPs but no memory traffic.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from core.graph import OpGraph, OpNode, TensorInfo
from core.mesh import DeviceMesh
from core.placement import Spec
from costmodel.device import conv_time_s, matmul_time_s
from costmodel.flops import conv_channels, matmul_alignment_bytes, matmul_narrow_dim, node_flops
from costmodel.fusion import FusedNode
from costmodel.memory import Precision
from hwprofiles.profile import DeviceSpec, HardwareProfile

BACKWARD_FLOPS_FACTOR = 2.0  # element-wise FLOPs of a backward, per forward FLOP
# Ops torch runs as views of their input (no data moved): they cost their launch only.
VIEW_OPS = frozenset({"Reshape", "Flatten", "Transpose", "Squeeze", "Unsqueeze", "Identity", "Expand", "Slice",
                      "SequenceAt", "SplitToSequence", "Split", "Dropout"})
BACKWARD_BYTES_FACTOR = 2.0
# The dtypes whose GEMMs run on tensor cores, which load 16-byte rows: where the profile's alignment
# fractions (measured in bf16) apply. fp32 without TF32 runs on the SIMT cores, which do not care.
TENSOR_CORE_DTYPES = frozenset({"bf16", "fp16", "tf32", "fp8"})


# Inputs whose gradients the calibrated backward of an element-wise op computes (hwprofiles/sweeps.py:
# every float input; a unary op's one): a node needing fewer runs that share of its kernels (x·c: dx only).
CALIBRATED_GRAD_INPUTS = {"Add": 2, "Sub": 2, "Mul": 2, "Div": 2, "Where": 2, "Concat": 2}


def _backward_memory_s(node: OpNode, dev: DeviceSpec, nbytes: float, fwd_mem_s: float, needed: int) -> float:
    """A memory-bound op's backward: at its op type's calibrated backward rate (per byte the forward
    moves), for the share of the calibrated input gradients the node needs; else 2× its forward."""
    rate = dev.elementwise_backward_rate(node.op_type) if node.op_type not in VIEW_OPS else None
    if rate is None:
        return BACKWARD_BYTES_FACTOR * fwd_mem_s
    return nbytes / rate * min(1.0, needed / CALIBRATED_GRAD_INPUTS.get(node.op_type, 1))


def cast_s(dev: DeviceSpec, numel: float) -> tuple[float, float]:
    """Autocast's cast of `numel` fp32 elements to bf16 (4 bytes read, 2 written), one kernel, and its
    gradient's back in backward."""
    t = with_launch(numel * 6.0 / dev.elementwise_rate("Cast"), dev.kernel_launch_s, dev.async_launch)
    return t, t


def with_launch(work_s: float, launch_s: float, overlapped: bool) -> float:
    """An op's time from its kernels' work and their launches: the longer of the two where the host
    launches ahead of the device (a GPU), their sum where the host runs the kernels (a CPU)."""
    return max(work_s, launch_s) if overlapped else work_s + launch_s


@dataclass(frozen=True, slots=True)
class ComputeCost:
    fwd_flops: float
    fwd_matmul_flops: float
    bwd_matmul_flops: float
    fwd_bytes: float
    fwd_s: float
    bwd_s: float

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_s


def tensor_bytes(info: TensorInfo, shape: tuple[int, ...], precision: Precision) -> float:
    return float(math.prod(shape)) * precision.bytes_of(info)


def local_shapes(node: OpNode, graph: OpGraph, specs: Mapping[str, Spec | None], mesh: DeviceMesh) -> dict[str, tuple[int, ...]]:
    out = {}
    for t in (*node.inputs, *node.outputs):
        if not t or t not in graph.tensors:
            continue
        spec = specs.get(t)
        shape = graph.tensors[t].shape
        out[t] = spec.local_shape(shape, mesh.shape) if spec is not None else shape
    return out


def compute_cost(node: OpNode, graph: OpGraph, shapes: Mapping[str, tuple[int, ...]], profile: HardwareProfile,
                 precision: Precision, *, on_chip: frozenset[str] = frozenset(),
                 needs_grad: frozenset[str] | None = None, fused: FusedNode | None = None,
                 padded: bool = False) -> ComputeCost:
    """`on_chip`: tensors that never reach memory (inside a fused kernel, e.g. attention scores);
    an op whose outputs are all on chip is part of that kernel: no memory traffic, no launch.
    `needs_grad`: the tensors backward computes a gradient for (None: all). A matmul's backward
    computes the gradient of each operand that needs one (the first layer's input needs none: one
    matmul, not two); an op none of whose inputs needs a gradient has no backward at all. `fused`: its
    place in a compiled runtime's fused chain (`fusion.py`): it moves only what enters or leaves the
    chain, at a streaming kernel's rate (an Add's), and only the chain's first node pays a launch.
    `padded`: GEMM dims are padded to aligned sizes before the matmul (Inductor's shape_padding), so
    none pays the profile's misalignment."""
    flops = node_flops(node, lambda t: shapes[t])
    nbytes = sum(tensor_bytes(graph.tensors[t], shapes[t], precision) for t in shapes
                 if graph.tensors[t].dtype != "sequence" and t not in on_chip)
    dev = profile.device
    in_kernel = bool(node.outputs) and all(t in on_chip for t in node.outputs if t)
    launch = 0.0 if in_kernel else dev.graph_op_s
    if fused is not None:  # one kernel per chain: what crosses its boundary, one launch
        nbytes = sum(tensor_bytes(graph.tensors[t], shapes[t], precision) for t in shapes
                     if (t in fused.external_inputs or t in fused.external_outputs) and graph.tensors[t].dtype != "sequence")
        launch = dev.graph_op_s if fused.head else 0.0
    elif node.op_type in VIEW_OPS:
        nbytes = 0.0
        if dev.async_launch:  # no kernel: host work the device does not wait for
            launch = 0.0
    dtype = precision.compute_dtype if precision.compute_dtype in dev.peak_flops_per_s else "fp32"
    # Matmuls stream at memory bandwidth; element-wise kernels at what they achieve (calibrated).
    mem_s = nbytes / (dev.mem_bandwidth_bytes_per_s if flops.matmul else
                      dev.elementwise_rate("Add" if fused is not None else node.op_type))
    peak = dev.peak_for(dtype)
    gemm = node.op_type in ("MatMul", "Gemm")
    mm_s = conv_time_s(dev, flops.matmul, conv_channels(node, lambda t: shapes[t]), dtype) \
        if node.op_type in ("Conv", "ConvTranspose") else \
        matmul_time_s(dev, flops.matmul, dtype, matmul_narrow_dim(node, lambda t: shapes[t])
                          if dev.matmul_narrow_efficiency is not None and gemm else None,
                      matmul_alignment_bytes(node, lambda t: shapes[t], 2 if precision.autocast else
                                             precision.activation_bytes)
                      if dev.matmul_alignment and gemm and not padded and dtype in TENSOR_CORE_DTYPES else 16)
    grads = [needs_grad is None or t in needs_grad for t in node.inputs if t]
    mm_grads = sum(grads[:2])  # of dX = dY·Wᵀ and dW = Xᵀ·dY, those needed
    fwd = with_launch(max(mm_s + flops.other / peak, mem_s), launch, dev.async_launch)
    bwd = with_launch(max(mm_grads * mm_s + BACKWARD_FLOPS_FACTOR * flops.other / peak,
                           _backward_memory_s(node, dev, nbytes, mem_s, sum(grads))
                           if not flops.matmul and fused is None else BACKWARD_BYTES_FACTOR * mem_s),
                       BACKWARD_FLOPS_FACTOR * launch, dev.async_launch) if any(grads) else 0.0
    if precision.cast_inputs and node.name in precision.cast_inputs:
        for t in precision.cast_inputs[node.name]:  # autocast's casts to bf16, and back in backward
            if t not in shapes:  # an attention chain's q or k: priced with the chain (`attention.flash_cost`)
                continue
            c_fwd, c_bwd = cast_s(dev, float(math.prod(shapes[t])))
            fwd += c_fwd
            bwd += c_bwd if needs_grad is None or t in needs_grad else 0.0
    return ComputeCost(fwd_flops=flops.total, fwd_matmul_flops=flops.matmul, bwd_matmul_flops=mm_grads * flops.matmul,
                       fwd_bytes=nbytes, fwd_s=fwd, bwd_s=bwd)
