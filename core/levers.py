"""The levers a plan is asked for and records, as typed values: every stage reads these, none parses
a string of its own. The values are the words the strategy file and the CLI use (`StrEnum`), so a
member prints, compares and serialises as its word.

`lever(Kind, value, name)` turns a user's word into the member, or raises `LeverError` naming the
lever and its choices; the CLI words that error with its own flag names.
"""

from __future__ import annotations

import enum
from typing import TypeVar

from core.errors import MeshplanError


class LeverError(MeshplanError):
    """A lever given a value it does not take."""

    def __init__(self, lever: str, value: object, choices: tuple[str, ...]) -> None:
        super().__init__(f"{lever} {value!r}: choose one of {', '.join(choices)}")
        self.lever, self.value, self.choices = lever, value, choices


class Mode(enum.StrEnum):
    """What the search decides (MindSpore's parallel_mode / search_mode)."""

    AUTO = "auto"  # the ILP over every op's strategies
    SEMI = "semi"  # the user's pins honoured, the rest decided
    DATA_PARALLEL = "data-parallel"  # inputs split on the batch dim over every axis, parameters replicated
    STAND_ALONE = "stand-alone"  # one device


class Dtype(enum.StrEnum):
    """The training step's precision (`costmodel.memory.PRECISIONS`)."""

    AMP = "amp"  # torch.autocast bf16 over fp32 weights, gradients and AdamW states; fp32 reductions
    MIXED = "mixed"  # FSDP2's MixedPrecisionPolicy(bf16, fp32): bf16 compute on cast weights, fp32 states
    BF16 = "bf16"  # Megatron's: bf16 weights and gradients, fp32 master weights in the optimizer
    FP16 = "fp16"
    FP32 = "fp32"


def default_dtype(gpu: bool) -> Dtype:
    """The precision a plan trains in unless told: on a GPU what FSDP2's MixedPrecisionPolicy and
    torchtitan run (bf16 compute on weights cast where gathered, fp32 master weights, gradients
    reduced and AdamW states in fp32), fp32 on a CPU."""
    return Dtype.MIXED if gpu else Dtype.FP32


class Runtime(enum.StrEnum):
    """How the framework runs the model's ops (`costmodel/fusion.py`)."""

    EAGER = "eager"  # op by op, each a kernel
    COMPILED = "compiled"  # torch.compile: the ops between matmuls fused into one kernel per chain


class Search(enum.StrEnum):
    ILP = "ilp"
    PROPAGATION = "propagation"  # greedy, in topological order: no ILP


class Recompute(enum.StrEnum):
    """Activation recomputation of the repeated layers (AUTO: the ILP counts the layers per group)."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"
    AUTO = "auto"


class Offload(enum.StrEnum):
    """Where a parameter's model states live between their uses (AUTO: the ILP decides per parameter).
    OPTIMIZER: its optimizer states (with mixed precision's master weights) in host memory and the
    optimizer step on the host (DeepSpeed's ZeRO-Offload): its gradient is copied to the host after
    backward, its updated weights back. PARAMS: its weights, gradients and optimizer states all in host
    memory (FSDP2's CPUOffloadPolicy): its weights copied to the device for each use (forward, and again
    for backward), its gradient to the host after each backward, the optimizer step on the host."""

    NONE = "none"
    OPTIMIZER = "optimizer"
    PARAMS = "params,optimizer"
    AUTO = "auto"


class ActivationOffload(enum.StrEnum):
    """Where the repeated layers' saved activations live between a layer's forward and its backward
    (AUTO: the ILP counts the layers per group): on the device, or copied to host memory as autograd
    saves them and back as backward reads them (`executor/host_activations.py`) — for ALL, every layer
    not recomputed."""

    NONE = "none"
    ALL = "all"
    AUTO = "auto"


def offload_levers(value: str) -> tuple[Offload, ActivationOffload]:
    """`offload`'s words as its two levers: the model states' place, and "activations" among the words
    for the saved activations' ("auto": both decided; "activations", "optimizer,activations", ...)."""
    words = [w.strip() for w in value.split(",")]
    acts = "activations" in words
    rest = ",".join(w for w in words if w != "activations")
    if acts and not rest:
        return Offload.NONE, ActivationOffload.ALL
    try:
        states = Offload(rest)
    except ValueError:
        states = None
    if states is None or (acts and states in (Offload.AUTO, Offload.NONE)):
        raise LeverError("offload", value, (*(m.value for m in Offload), "activations", "optimizer,activations",
                                            "params,optimizer,activations"))
    if acts:
        return states, ActivationOffload.ALL
    return states, ActivationOffload.AUTO if states is Offload.AUTO else ActivationOffload.NONE


class Schedule(enum.StrEnum):
    """A pipeline's schedule (torch.distributed.pipelining's)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"


class Attention(enum.StrEnum):
    """How the runtime runs attention: FlashAttention, torch's eager ops, Megatron-LM's fused softmax."""

    FLASH = "flash"
    EAGER = "eager"
    FUSED_SOFTMAX = "fused-softmax"


class CpMethod(enum.StrEnum):
    """How an attention whose queries are split over cp sees every key and value (`costmodel/context.py`)."""

    ALLGATHER = "allgather"  # gathered over cp before it, their gradients reduce-scattered (Llama-3's)
    RING = "ring"  # passed rank to rank, each block's attention computed as it arrives (ring attention)
    AUTO = "auto"  # the faster of the two, as priced


class LossKind(enum.StrEnum):
    """The training loss on the model's first output (AUTO: cross-entropy on logits, else MSE)."""

    AUTO = "auto"
    CROSS_ENTROPY = "cross-entropy"
    MSE = "mse"


class Composer(enum.StrEnum):
    """How a step's priced items add up: one after another, or communication under compute."""

    SERIAL = "serial"
    OVERLAP = "overlap"


E = TypeVar("E", bound=enum.StrEnum)


def lever(kind: type[E], value: str | E, name: str) -> E:
    """`value` as a member of `kind`, or LeverError naming the lever `name` and its choices."""
    try:
        return kind(value)
    except ValueError:
        raise LeverError(name, value, tuple(m.value for m in kind)) from None
