"""Expert parallelism on the user's module (`meshplan.apply`): each block whose expert gathers the plan
splits over the `ep` axis runs its experts where they are, as torchtitan's `ExpertParallel` style does.

The block's experts module (transformers' `MixtralExperts`, `Qwen3MoeExperts`, `DeepseekV3NaiveMoe`:
the routed experts' stacked `[E, …]` weights, called as `experts(hidden_states, top_k_index,
top_k_weights)`) keeps E/ep experts per rank: its weights become DTensors split on dim 0 over ep (their
names and `full_tensor()` unchanged). Its forward routes as `run` does (`executor/experts.Routed`): each
token's top-k slots sorted by expert, the counts exchanged, each slot's token sent to its expert's rank
(`all_to_all_single`), the module's own forward run there on the tokens received (each one slot: its
local expert id, weight 1), the results sent back and summed into the tokens by their routing weights
(transformers' experts scale each expert's output by its weight: the module's output is linear in
them, and they need not travel). No slot is dropped, as the module drops none. Backward is autograd
through the two all-to-alls.

Gradients: a rank's experts receive every ep rank's slots, so their gradients hold the sum over the ep
group's losses; the experts are outside fully_shard / DDP (their `ignored_params` / `ignored_modules`),
and their gradient is divided by the batch's shares (the data-parallel mean the rest gets from its
reduction) and all-reduced over the data-parallel ranks holding the same experts (the plan's reduction
"only over the ranks that hold the same expert").
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from core.experts import EP_AXIS, EXPERT_PARALLEL, ExpertBlock, find_expert_blocks
from core.graph import OpGraph
from executor.binding import ApplyError, Binding
from executor.experts import Routed
from planner.strategy import Strategy


@dataclass(frozen=True)
class ExpertModule:
    """A block's experts module in the user's model and the ONNX block it is."""

    fqn: str
    module: nn.Module
    block: ExpertBlock


def expert_parallel_blocks(s: Strategy, graph: OpGraph) -> tuple[ExpertBlock, ...]:
    """The blocks whose expert gathers the plan splits over ep."""
    return tuple(b for b in find_expert_blocks(graph) if EXPERT_PARALLEL in s.nodes[b.gathers[0]].kernels)


def expert_modules(blocks: tuple[ExpertBlock, ...], module: nn.Module,
                   bindings: tuple[Binding, ...]) -> list[ExpertModule]:
    """Each block's experts module: the one module holding its routed experts' weights, called with the
    tokens, their experts and their weights; or one line saying why not."""
    by_onnx = {b.onnx: b for b in bindings}
    out = []
    for block in blocks:
        fqns = {by_onnx[p].fqns[0] for p in block.experts if p in by_onnx}
        parents = {f.rpartition(".")[0] for f in fqns}
        where = block.module or block.topk
        if len(fqns) < len(block.experts) or len(parents) != 1:
            raise ApplyError(f"the experts of {where} are not the weights of one module here ({sorted(fqns)}); apply "
                             "runs expert parallelism on one experts module per block (run the plan with `meshplan run`)")
        fqn = parents.pop()
        experts = module.get_submodule(fqn)
        own = {f"{fqn}.{n}" for n, _ in experts.named_parameters()}
        if own != fqns:
            raise ApplyError(f"{fqn} holds parameters besides the routed experts' ({sorted(own - fqns)[0]}); apply "
                             "splits an experts module's weights over ep whole (run the plan with `meshplan run`)")
        params = [p for p in inspect.signature(experts.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(params) != 3:
            raise ApplyError(f"{fqn} is called as {type(experts).__name__}({', '.join(p.name for p in params)}); apply "
                             "runs expert parallelism on experts called as experts(hidden_states, top_k_index, "
                             "top_k_weights) (transformers' MoE blocks); run the plan with `meshplan run`")
        out.append(ExpertModule(fqn, experts, block))
    return out


class _ExpertGradients(torch.autograd.Function):
    """Identity forward; backward the expert weight's gradient as the data-parallel mean: divided by the
    batch's shares, summed over the ranks holding the same experts (`group`, None where there are none)."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, shares: int, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.shares, ctx.group = shares, group
        return w.view_as(w)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        g = g / ctx.shares
        if ctx.group is not None:
            dist.all_reduce(g, group=ctx.group)
        return g, None, None


def _ep_forward(experts: nn.Module, forward: Callable[..., torch.Tensor], num_experts: int, group: dist.ProcessGroup,
                ep: int, shares: int, replicas: dist.ProcessGroup | None) -> Callable[..., torch.Tensor]:
    """The experts module's forward under expert parallelism; `forward`: its own, run on the slots received
    with this rank's experts' weights in place of the split ones (as `torch.func.functional_call` swaps
    them; called directly, the module's `forward` being this)."""

    def run(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, k = top_k_index.shape
        routed = Routed.of(top_k_index, num_experts, group, ep)
        x = routed.dispatch(hidden_states, per=k)  # slot t·k + j is token t's j-th expert
        local = {}
        for n, p in experts.named_parameters(recurse=False):
            w = _ExpertGradients.apply(p.to_local() if isinstance(p, DTensor) else p, shares, replicas)
            local[n] = w.to(x.dtype) if w.dtype != x.dtype else w  # (a mixed plan's bf16 compute)
        ids = routed.local_ids.reshape(-1, 1)
        held, count = dict(experts._parameters), getattr(experts, "num_experts", None)
        try:  # (transformers' experts size their groups by `num_experts`: this rank's)
            experts._parameters.update(local)
            if count is not None:
                setattr(experts, "num_experts", num_experts // ep)  # noqa: B010 (an attribute nn.Module types as its own)
            y = forward(x, ids, torch.ones(ids.shape, dtype=top_k_weights.dtype, device=ids.device))
        finally:
            experts._parameters.update(held)
            if count is not None:
                setattr(experts, "num_experts", count)  # noqa: B010
        if y.grad_fn is None and torch.is_grad_enabled():  # no slot here (an eager loop's zeros): backward
            # must still run both all-to-alls and the experts' reductions, as every other rank does
            y = y + 0 * (x.sum() + sum(w.sum() for w in local.values()))
        back = routed.combine(y).reshape(tokens, k, -1)
        return (back * top_k_weights.unsqueeze(-1).to(back.dtype)).sum(1).to(hidden_states.dtype)

    return run


def apply_expert_parallel(s: Strategy, graph: OpGraph, module: nn.Module, mesh: DeviceMesh,
                          bindings: tuple[Binding, ...], report: Any) -> None:
    """Split each expert-parallel block's experts over ep and route its tokens there (`report.experts`
    their modules, for data parallelism to leave alone). Nothing where the plan splits no experts."""
    blocks = expert_parallel_blocks(s, graph)
    if not blocks:
        return
    names = tuple(s.mesh.axis_names)
    ep = s.mesh.shape[names.index(EP_AXIS)]
    others = [n for n, size in zip(names, s.mesh.shape, strict=True) if n != EP_AXIS and size > 1]
    if others not in ([], ["dp_replicate"]):
        raise ApplyError(f"apply runs expert parallelism with ep as the only split besides dp_replicate; this plan's mesh "
                         f"is {dict(zip(names, s.mesh.shape, strict=True))}: plan with `layout` dp_shard={ep},ep={ep} "
                         "(or dp_replicate=R,dp_shard=E,ep=E), or run it with `meshplan run`")
    if report.precision in ("bf16", "fp16"):
        raise ApplyError(f"apply runs expert parallelism in fp32, amp or mixed; this plan is {report.precision}")
    group = mesh[EP_AXIS].get_group()
    replicas = mesh["dp_replicate"].get_group() if others else None
    found = expert_modules(blocks, module, bindings)
    split_weights = 0
    for e in found:
        for name, p in list(e.module.named_parameters(recurse=False)):
            if p.shape[0] % ep:
                raise ApplyError(f"{e.fqn}.{name}: {p.shape[0]} experts do not split over ep={ep}")
            split = nn.Parameter(distribute_tensor(p.detach(), mesh[EP_AXIS], [Shard(0)]), requires_grad=p.requires_grad)
            setattr(e.module, name, split)
            split_weights += 1
        e.module.forward = _ep_forward(e.module, e.module.forward, e.block.num_experts, group, ep,
                                       report.dp_size, replicas)
    report.experts = [e.fqn for e in found]
    report.ep = ep
    # Per micro-batch and block: the counts, the dispatch and the combine forward, the two again backward;
    # a recomputed block forward again; each expert weight's gradient over the replicas.
    again = sum(1 for e in found if any(e.fqn.startswith(r + ".") for r in report.recomputed))
    counts = Counter({"all_to_all": 5 * len(found) + 3 * again})
    if replicas is not None:
        counts["all_reduce"] = split_weights
    report.expected = dict(Counter(report.expected) + counts)
