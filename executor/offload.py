"""Optimizer states the plan keeps in host memory (`core.levers.Offload.OPTIMIZER`, ZeRO-Offload), as
`meshplan run` executes them: each such parameter (or ZeRO shard) is stepped through an fp32 copy in
host memory — pinned on a GPU — with AdamW's states beside it. Before the step its reduced gradient is
copied to the host; after the host's step the updated weights are copied back. On a CPU rank the moves
are between two tensors of the same memory, so the path run is the one a GPU runs, its copies included.
The weights, gradients and optimizer states all on the host (`Offload.PARAMS`) run under
`meshplan.apply` (FSDP2's CPUOffloadPolicy); `run` keeps every weight on its device."""

from __future__ import annotations

import torch

from core.levers import Offload
from executor.preflight import RunError
from executor.spmd import SpmdRunner


class HostStates:
    """The optimizer's parameters with the offloaded ones replaced by their host copies (`params`, in
    the runner's order), and the copies around the step (`before_step`, `after_step`)."""

    def __init__(self, runner: SpmdRunner, offload: dict[str, Offload], device: torch.device) -> None:
        self.pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        self.params: list[torch.nn.Parameter] = []
        for names, p in runner.optimizer_groups():
            modes = {offload.get(n, Offload.NONE) for n in names}  # (params,optimizer: refused by `check_step`)
            if len(modes) > 1:
                raise RunError(f"a ZeRO bucket holds {names[0]} and {names[-1]}, whose optimizer states the plan keeps "
                               "one on the host and one on the device; plan with one offload for both")
            if modes == {Offload.OPTIMIZER}:
                host = p.detach().to("cpu", torch.float32, copy=True)
                host = torch.nn.Parameter(host.pin_memory() if device.type == "cuda" else host)
                self.pairs.append((p, host))
                self.params.append(host)
            else:
                self.params.append(p)
        self.host = {id(h) for _, h in self.pairs}
        self.stepped = {id(p): h for p, h in self.pairs}  # the runner's parameter → its host copy (checkpoints)

    def before_step(self) -> None:
        """Each offloaded gradient to the host."""
        for p, h in self.pairs:
            h.grad = None if p.grad is None else p.grad.detach().to("cpu", torch.float32, copy=True)

    def after_step(self) -> None:
        """The host's updated weights back to the device (before ZeRO gathers the shards)."""
        with torch.no_grad():
            for p, h in self.pairs:
                p.copy_(h, non_blocking=True)
        if self.pairs and self.pairs[0][0].is_cuda:
            torch.cuda.current_stream().synchronize()

    def host_bytes(self, optim: torch.optim.Optimizer) -> int:
        """What the host holds for them: the fp32 weights, their gradients, AdamW's states."""
        out = 0
        for _, h in self.pairs:
            out += h.numel() * h.element_size() + (h.grad.numel() * h.grad.element_size() if h.grad is not None else 0)
            out += sum(v.numel() * v.element_size() for v in optim.state.get(h, {}).values()
                       if isinstance(v, torch.Tensor) and v.dim() > 0)
        return out
