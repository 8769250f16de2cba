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
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single

from core.experts import ExpertRegion
from core.graph import OpGraph


def run_expert_region(region: ExpertRegion, values: Mapping[tuple[str, int], Any], graph: OpGraph,
                      group: dist.ProcessGroup, ep: int, run: Callable[[str, list[Any]], list[Any]]) -> torch.Tensor:
    """The region's output rows for this rank's slots, computed on the ranks of `group` (the ep axis, `ep`
    ranks) holding their experts. `values`: each region input, local as the plan places it (the weights
    this rank's experts, the ids and rows this rank's slots); `run`: one node on local inputs."""
    experts = region.block.num_experts
    mine = experts // ep
    ids = values[region.ids[0]].reshape(-1).to(torch.int64)
    order = torch.argsort(ids, stable=True)
    per_expert = torch.bincount(ids, minlength=experts)
    received = torch.empty_like(per_expert)
    dist.all_to_all_single(received, per_expert, group=group)  # [source, my experts] counts
    grid = received.view(ep, mine)
    send = per_expert.view(ep, mine).sum(1).tolist()
    recv = grid.sum(1).tolist()
    local_ids = torch.repeat_interleave(torch.arange(mine, device=ids.device).repeat(ep), grid.reshape(-1))
    env: dict[str, Any] = {}
    for key, value in values.items():
        t = graph.node_by_name[key[0]].inputs[key[1]]
        if key in region.ids:
            env[t] = local_ids.reshape(-1, *value.shape[1:]).to(value.dtype)
        elif key in region.rows:
            rows = value[order].contiguous()
            out = rows.new_empty((sum(recv), *rows.shape[1:]))
            env[t] = all_to_all_single(out, rows, recv, send, group=group)  # dispatch
        else:
            env[t] = value
    for name in region.nodes:
        node = graph.node_by_name[name]
        outs = run(name, [env.get(t) if t else None for t in node.inputs])
        env.update(zip(node.outputs, outs, strict=False))
    y = env[region.output].contiguous()
    back = all_to_all_single(y.new_empty((len(ids), *y.shape[1:])), y, send, recv, group=group)  # combine
    return back[torch.argsort(order)]
