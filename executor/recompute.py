"""Selective recomputation as the cost model prices it (`costmodel/step.py`, RECOMPUTE), for both the
executor (`run`) and `meshplan.apply`: torch.utils.checkpoint's op-level selective checkpointing
(torchtitan's `op_sac`) with one policy — in each layer the outputs of attention and of every other
matmul (the 1st, 3rd, …, counted apart in forward and in recomputation) saved; everything else,
collectives too (a parameter gathered inside the layer is gathered again, as under full recomputation,
not held), recomputed from them in backward."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree

MATMULS = ("mm", "addmm", "bmm")
SAVED = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
         "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")


def selective_contexts(on_saved: Callable[[list[torch.Tensor]], object] | None = None) -> tuple[Any, Any]:
    """One checkpointed layer's (forward, recomputation) contexts. `on_saved(tensors)`: told what the
    forward saved (a memory meter's `keep`); its record is held until the recomputation has used them."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    counts: dict[str, int] = {}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        name = op._overloadpacket.__name__ if hasattr(op, "_overloadpacket") else ""
        if name in MATMULS:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] = counts.get(key, 0) + 1
            return CheckpointPolicy.MUST_SAVE if counts[key] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if name in SAVED else CheckpointPolicy.PREFER_RECOMPUTE

    forward, recompute = create_selective_checkpoint_contexts(policy)
    if on_saved is None:
        return forward, recompute
    held: list[object] = []

    @contextlib.contextmanager
    def metered_forward() -> Iterator[None]:
        with forward:
            yield
        saved = [leaf.val for entries in forward.storage.values() for entry in entries.values()
                 for leaf in pytree.tree_leaves(entry, is_leaf=lambda x: hasattr(x, "val"))
                 if isinstance(getattr(leaf, "val", None), torch.Tensor)]  # (torch's: key → index → wrapped output)
        held.append(on_saved(saved))

    @contextlib.contextmanager
    def metered_recompute() -> Iterator[None]:
        with recompute:
            yield
        held.clear()

    return metered_forward(), metered_recompute()
