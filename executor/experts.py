"""Expert parallelism in the executor: a block whose expert gathers the plan splits over the ep axis
(kernel `EXPERT_PARALLEL`) runs its expert region (`core/experts.ExpertRegion`) where the experts are.

Each rank holds E/ep experts (its shard of the stacked weights) and its own tokens' routed slots. It
sorts its slots by expert, tells every rank of its ep group how many it sends each of that rank's
experts (one all-to-all of E counts), sends each slot's token to its expert's rank (the dispatch
all-to-all), runs the region's ops there on the slots it received with their local expert ids (the same
row-wise ops: gather, grouped matmuls, activation), and sends each result back (the combine
all-to-all), unsorted into its slot's place. Backward is autograd through the two token all-to-alls
(each its transpose). No slot is dropped: transformers' Mixtral, Qwen-MoE and DeepSeek-V3 route every
token, with no capacity, and so does this; the planner's capacity factor only prices the imbalance.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single

from core.experts import ExpertRegion
from core.graph import OpGraph


@dataclass(frozen=True)
class Routed:
    """One rank's routed slots sent to their experts' ranks: the slots' order by expert, how many it sends
    each rank and receives from each, and the local expert id of each slot it received."""

    group: dist.ProcessGroup
    order: torch.Tensor
    send: list[int]
    recv: list[int]
    local_ids: torch.Tensor

    @staticmethod
    def of(ids: torch.Tensor, experts: int, group: dist.ProcessGroup, ep: int) -> Routed:
        """`ids`: each slot's expert (any shape); one all-to-all of the E per-expert counts."""
        flat = ids.reshape(-1).to(torch.int64)
        mine = experts // ep
        order = torch.argsort(flat, stable=True)
        per_expert = torch.bincount(flat, minlength=experts)
        received = torch.empty_like(per_expert)
        dist.all_to_all_single(received, per_expert, group=group)  # [source, my experts] counts
        grid = received.view(ep, mine)
        local_ids = torch.repeat_interleave(torch.arange(mine, device=flat.device).repeat(ep), grid.reshape(-1))
        return Routed(group, order, per_expert.view(ep, mine).sum(1).tolist(), grid.sum(1).tolist(), local_ids)

    def dispatch(self, rows: torch.Tensor, per: int = 1) -> torch.Tensor:
        """Each slot's row sent to its expert's rank, by source rank then expert; `rows` one per slot, or
        one per `per` consecutive slots (a token's top-k)."""
        rows = rows[self.order // per if per > 1 else self.order].contiguous()
        return all_to_all_single(rows.new_empty((sum(self.recv), *rows.shape[1:])), rows, self.recv, self.send,
                                 group=self.group)

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        """The experts' results sent back, each in its slot's place (the transpose of `dispatch`)."""
        y = y.contiguous()
        back = all_to_all_single(y.new_empty((len(self.order), *y.shape[1:])), y, self.send, self.recv,
                                 group=self.group)
        return back[torch.argsort(self.order)]


def run_expert_region(region: ExpertRegion, values: Mapping[tuple[str, int], Any], graph: OpGraph,
                      group: dist.ProcessGroup, ep: int, run: Callable[[str, list[Any]], list[Any]]) -> torch.Tensor:
    """The region's output rows for this rank's slots, computed on the ranks of `group` (the ep axis, `ep`
    ranks) holding their experts. `values`: each region input, local as the plan places it (the weights
    this rank's experts, the ids and rows this rank's slots); `run`: one node on local inputs."""
    routed = Routed.of(values[region.ids[0]], region.block.num_experts, group, ep)
    env: dict[str, Any] = {}
    for key, value in values.items():
        t = graph.node_by_name[key[0]].inputs[key[1]]
        if key in region.ids:
            env[t] = routed.local_ids.reshape(-1, *value.shape[1:]).to(value.dtype)
        elif key in region.rows:
            env[t] = routed.dispatch(value)
        else:
            env[t] = value
    for name in region.nodes:
        node = graph.node_by_name[name]
        outs = run(name, [env.get(t) if t else None for t in node.inputs])
        env.update(zip(node.outputs, outs, strict=False))
    return routed.combine(env[region.output])
