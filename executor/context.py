"""Ring attention (context parallelism's ring design, `core/context.py`) on a process group.

Each rank holds its queries' rows and one block of keys (kᵀ) and values, split on their tokens in
contiguous chunks: rank r holds block r. cp times it computes its queries against the block it holds
— the mask's columns of that block added —, merges the block's softmax into the running one by their
log-sum-exps, and passes the block to the next rank while taking the previous rank's (`dist.isend` /
`irecv`; the last block is not passed on). Backward runs through the same ops: each pass's gradient
goes back the way the block came (`_Pass`). The result equals softmax(q·kᵀ + mask)·v over all keys
(a row the mask leaves no key: 0, as the exporter's NaN guard makes it). A reference implementation
for gloo: each exchange is waited for before the block is computed (no overlap), each block's scores
are written to memory and every received block is kept for backward (the all-gather's memory).

Each pass is counted (`passes`), for the run's report against the plan's `send_recv`s.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class _Pass(torch.autograd.Function):
    """A block to the next rank of the ring and the previous rank's taken; its gradient back."""

    passes = 0

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, to: int, frm: int) -> torch.Tensor:
        ctx.group, ctx.to, ctx.frm = group, to, frm
        return _exchange(x, group, to, frm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _exchange(grad, ctx.group, ctx.frm, ctx.to), None, None, None


def _exchange(x: torch.Tensor, group: dist.ProcessGroup, to: int, frm: int) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, to, group),
                                        dist.P2POp(dist.irecv, out, frm, group)]):
        work.wait()
    _Pass.passes += 1
    return out


def ring_passes() -> int:
    """Passes run in this process so far (forward and backward)."""
    return _Pass.passes


def ring_attention(q: torch.Tensor, kt: torch.Tensor, mask: torch.Tensor | None, v: torch.Tensor,
                   group: dist.ProcessGroup) -> torch.Tensor:
    """softmax(q·kᵀ + mask)·v with kᵀ and v split on their tokens over `group` (this rank's block:
    its rank's), `mask` holding this rank's query rows against every key; the scale is in q and kᵀ."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    to, frm = dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)
    cols = kt.shape[-1]
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    k_blk, v_blk = kt, v
    for i in range(n):
        j = (r - i) % n  # the rank whose block this is
        s = torch.matmul(q, k_blk)
        if mask is not None:
            s = s + mask[..., j * cols:(j + 1) * cols]
        dead = torch.isneginf(s).all(dim=-1, keepdim=True)  # rows this block masks whole (causal: later keys)
        s = s.masked_fill(dead, 0.0)
        blk = torch.logsumexp(s, dim=-1, keepdim=True).masked_fill(dead, float("-inf"))
        o = torch.matmul(torch.softmax(s, dim=-1), v_blk)
        if out is None or lse is None:
            out, lse = o.masked_fill(dead, 0.0), blk
        else:  # (a row masked whole so far keeps -inf: its weights 0, not exp(-inf + inf))
            new = torch.logaddexp(lse, blk)
            safe = new.masked_fill(torch.isneginf(new), 0.0)
            out = out * torch.exp(lse - safe) + o * torch.exp(blk - safe)
            lse = new
        if i < n - 1:
            k_blk, v_blk = _Pass.apply(k_blk, group, to, frm), _Pass.apply(v_blk, group, to, frm)
    assert out is not None
    return out
