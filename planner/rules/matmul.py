"""MatMul and Gemm: batch, row (M), column (N) and contraction (K) splits.

One mesh axis, A[..., M, K] @ B[..., K, N] = Y[..., M, N]:
  batch  A S(b), B S(b) (R where B broadcasts)  → Y S(b)
  M      A S(M), B R                            → Y S(M)     (Megatron "column" input side)
  N      A R,    B S(N)                         → Y S(N)     (column-parallel weight)
  K      A S(K), B S(K)                         → Y P        (row-parallel weight: partial sums)
Gemm adds C; with K split, C must be Partial too (added once in the sum), else it follows Y.

Einsum's strategies are generated from its equation, as DTensor does for mm-like ops: an output
letter splits on every operand that has it (R where an operand lacks it or broadcasts it), a
contracted letter splits on every operand that has it and leaves the output Partial. Equations with
an ellipsis or a letter repeated within one operand (a diagonal) get the replicated strategy only.
"""

from __future__ import annotations

from core.placement import P, Placement, R, Shard
from planner.rules.registry import AxisStrategy, OpContext, register_rule


def _batch_placement(shape: tuple[int, ...], out_rank: int, out_dim: int, out_size: int) -> Placement:
    """An operand's placement for an output batch dim: split where it has that dim, else broadcast (R)."""
    d = out_dim - (out_rank - len(shape))
    return Shard(d) if d >= 0 and shape[d] == out_size else R


@register_rule("MatMul")
def matmul_rule(ctx: OpContext) -> list[AxisStrategy]:
    a, b = ctx.in_shapes
    y = ctx.out_shapes[0]
    ra, rb, ry = len(a), len(b), len(y)
    out: list[AxisStrategy] = []
    # Batch dims of Y: all but its last two (fewer when an operand is a vector).
    n_batch = ry - (ra >= 2) - (rb >= 2)
    for d in range(n_batch):
        pa = _batch_placement(a[:-2], n_batch, d, y[d]) if ra > 2 else R
        pb = _batch_placement(b[:-2], n_batch, d, y[d]) if rb > 2 else R
        if isinstance(pa, Shard) or isinstance(pb, Shard):
            out.append(AxisStrategy(inputs=(pa, pb), outputs=(Shard(d),)))
    if ra >= 2:
        out.append(AxisStrategy(inputs=(Shard(ra - 2), R), outputs=(Shard(ry - 1 - (rb >= 2)),)))
    if rb >= 2:
        out.append(AxisStrategy(inputs=(R, Shard(rb - 1)), outputs=(Shard(ry - 1),)))
    out.append(AxisStrategy(inputs=(Shard(ra - 1), Shard(max(rb - 2, 0))), outputs=(P,)))
    # Linearity: a partial operand times a replicated one stays partial.
    out.append(AxisStrategy(inputs=(P, R), outputs=(P,)))
    out.append(AxisStrategy(inputs=(R, P), outputs=(P,)))
    return out


@register_rule("Gemm")
def gemm_rule(ctx: OpContext) -> list[AxisStrategy]:
    trans_a, trans_b = bool(ctx.node.attr("transA", 0)), bool(ctx.node.attr("transB", 0))
    m_a, k_a = (1, 0) if trans_a else (0, 1)
    k_b, n_b = (1, 0) if trans_b else (0, 1)
    y = ctx.out_shapes[0]
    has_c = len(ctx.in_shapes) > 2 and bool(ctx.node.inputs[2])

    def c_for(y_dim: int) -> tuple[Placement | None, ...]:
        if not has_c:
            return ()
        c = ctx.in_shapes[2]
        d = y_dim - (2 - len(c))
        return (Shard(d) if d >= 0 and c[d] == y[y_dim] and y[y_dim] > 1 else R,)

    return [
        AxisStrategy(inputs=(Shard(m_a), R, *c_for(0)), outputs=(Shard(0),)),
        AxisStrategy(inputs=(R, Shard(n_b), *c_for(1)), outputs=(Shard(1),)),
        AxisStrategy(inputs=(Shard(k_a), Shard(k_b), *((P,) if has_c else ())), outputs=(P,)),
    ]


def parse_einsum(equation: str, n_inputs: int) -> tuple[list[str], str] | None:
    eq = equation.replace(" ", "")
    if "." in eq:
        return None
    lhs, arrow, out = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != n_inputs:
        return None
    if not arrow:  # implicit output: the letters that appear once, in alphabetical order
        letters = "".join(terms)
        out = "".join(sorted(ch for ch in set(letters) if letters.count(ch) == 1))
    if any(len(set(t)) != len(t) for t in (*terms, out)):
        return None
    return terms, out


@register_rule("Einsum")
def einsum_rule(ctx: OpContext) -> list[AxisStrategy]:
    parsed = parse_einsum(str(ctx.node.attr("equation", "")), len(ctx.in_shapes))
    if parsed is None:
        return []
    terms, out = parsed
    y = ctx.out_shapes[0]
    strategies: list[AxisStrategy] = []
    for letter in dict.fromkeys("".join(terms)):
        ins: list[Placement | None] = []
        for term, shape in zip(terms, ctx.in_shapes, strict=True):
            d = term.find(letter)
            size = y[out.index(letter)] if letter in out else None
            ins.append(Shard(d) if d >= 0 and (size is None or shape[d] == size) else R)
        if letter in out:
            if any(isinstance(p, Shard) for p in ins):
                strategies.append(AxisStrategy(inputs=tuple(ins), outputs=(Shard(out.index(letter)),)))
        elif all(isinstance(p, Shard) for p, t in zip(ins, terms, strict=True) if letter in t):
            strategies.append(AxisStrategy(inputs=tuple(ins), outputs=(P,)))
    return strategies
