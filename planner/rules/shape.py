"""Views and data movement: which input dim becomes which output dim.

  Transpose(perm)      S(perm[o]) → S(o)
  Reshape, Flatten     dims are grouped where products match ([a, b] ↔ [a·b]); a split of a group's
                       leading dim survives the view when every shard stays contiguous (even splits),
                       as DTensor's view ops decide
  Squeeze, Unsqueeze   the non-1 dims keep their order
  Expand               dims that are not broadcast follow
  Slice                dims that are not sliced follow
  Concat, Split        dims other than the axis follow (all inputs/outputs alike)
  SplitToSequence, SequenceAt   as Split, through the sequence value
Views are linear: Partial passes through all of them.
"""

from __future__ import annotations

from core.placement import P
from planner.rules.registry import AxisStrategy, OpContext, follow, register_rule


def _with_partial(ctx: OpContext, strategies: list[AxisStrategy], data_inputs: int = 1) -> list[AxisStrategy]:
    ins = tuple(P if i < data_inputs and ctx.placeable[i] else None for i in range(len(ctx.in_shapes)))
    return [*strategies, AxisStrategy(inputs=ins, outputs=(P,) * len(ctx.out_shapes))]


@register_rule("Transpose")
def transpose_rule(ctx: OpContext) -> list[AxisStrategy]:
    r = ctx.rank()
    perm = ctx.node.attr("perm") or tuple(reversed(range(r)))
    return _with_partial(ctx, follow(ctx, [(int(perm[o]), o) for o in range(r)]))  # type: ignore[index]


def view_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Contiguous dim groups with equal products: (2, 3, 4) → (6, 4) gives [([0, 1], [0]), ([2], [1])]."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) and j < len(dst):
        gi, gj = [i], [j]
        pa, pb = src[i], dst[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(src):
                gi.append(i)
                pa *= src[i]
                i += 1
            elif j < len(dst):
                gj.append(j)
                pb *= dst[j]
                j += 1
            else:
                return groups  # products never meet (a malformed view): no mapping beyond here
        groups.append((gi, gj))
    return groups


@register_rule("Reshape", "Flatten")
def reshape_rule(ctx: OpContext) -> list[AxisStrategy]:
    pairs = []
    for gi, gj in view_groups(ctx.in_shapes[0], ctx.out_shapes[0]):
        lead_i = next((d for d in gi if ctx.in_shapes[0][d] > 1), None)
        lead_j = next((d for d in gj if ctx.out_shapes[0][d] > 1), None)
        if lead_i is not None and lead_j is not None:
            pairs.append((lead_i, lead_j))
    return _with_partial(ctx, follow(ctx, pairs, even=True))


@register_rule("Squeeze", "Unsqueeze")
def squeeze_rule(ctx: OpContext) -> list[AxisStrategy]:
    src = [d for d, s in enumerate(ctx.in_shapes[0]) if s > 1]
    dst = [d for d, s in enumerate(ctx.out_shapes[0]) if s > 1]
    return _with_partial(ctx, follow(ctx, list(zip(src, dst, strict=False))))


@register_rule("Expand")
def expand_rule(ctx: OpContext) -> list[AxisStrategy]:
    x, y = ctx.in_shapes[0], ctx.out_shapes[0]
    off = len(y) - len(x)
    return _with_partial(ctx, follow(ctx, [(d, d + off) for d in range(len(x)) if x[d] == y[d + off] > 1]))


@register_rule("Slice")
def slice_rule(ctx: OpContext) -> list[AxisStrategy]:
    x, y = ctx.in_shapes[0], ctx.out_shapes[0]
    return _with_partial(ctx, follow(ctx, [(d, d) for d in range(len(x)) if x[d] == y[d] > 1]))


@register_rule("Concat")
def concat_rule(ctx: OpContext) -> list[AxisStrategy]:
    r = ctx.out_rank()
    axis = ctx.axis_attr("axis", 0, r)
    data = [i for i, p in enumerate(ctx.placeable) if p]
    strategies = follow(ctx, [(d, d) for d in range(r) if d != axis and ctx.out_shapes[0][d] > 1], inputs=data)
    if len(data) == len(ctx.in_shapes):  # a constant piece would be repeated on every rank
        strategies = _with_partial(ctx, strategies, data_inputs=len(data))
    return strategies


@register_rule("Split", "SplitToSequence")
def split_rule(ctx: OpContext) -> list[AxisStrategy]:
    r = ctx.rank()
    axis = ctx.axis_attr("axis", 0, r)
    return _with_partial(ctx, follow(ctx, [(d, d) for d in range(r) if d != axis and ctx.in_shapes[0][d] > 1]))


@register_rule("SequenceAt")
def sequence_at_rule(ctx: OpContext) -> list[AxisStrategy]:
    seq, y = ctx.in_shapes[0], ctx.out_shapes[0]
    if len(seq) != len(y):  # keepdims = 0 dropped the split axis: not mapped
        return []
    return _with_partial(ctx, follow(ctx, [(d, d) for d in range(len(y)) if seq[d] == y[d] > 1]))
