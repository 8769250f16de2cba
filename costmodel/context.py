"""Context parallelism's causal load balance: each rank's share of a causal attention's work when the
sequence is split over cp ranks.

A causal mask leaves query i the keys 0…i: the score blocks a rank computes grow with the positions of
its queries. Split in cp contiguous chunks, rank r computes r full blocks and half a diagonal one —
(r + ½)/cp² of the s² grid, the last rank (2cp − 1)× the first. The zig-zag order (torch's
`context_parallel` load balancer, Megatron-LM's) cuts the sequence in 2·cp chunks and gives rank r
chunks r and 2cp − 1 − r: (r + ½ + 2cp − 1 − r + ½)/(2cp)² = 1/(2cp) of the grid each, half of 1/cp,
the mean — every rank alike.

The cost model prices a query shard of s/cp rows against all s keys, halved under a causal mask
(`costmodel/flash.py`): exactly the zig-zag share, the order the planned step assumes. (`run` splits
the sequence contiguously: the same numbers, its last rank holding (2cp − 1)/cp of the mean.)
"""

from __future__ import annotations


def causal_shares(cp: int, *, zigzag: bool = True) -> tuple[float, ...]:
    """Each of `cp` ranks' share of a causal attention's s² score grid (the diagonal's blocks at half)
    with the sequence split in the zig-zag order (2·cp chunks, rank r holding r and 2cp − 1 − r) or in
    cp contiguous chunks."""
    if zigzag:
        return tuple(((r + 0.5) + (2 * cp - 1 - r + 0.5)) / (2 * cp) ** 2 for r in range(cp))
    return tuple((r + 0.5) / cp**2 for r in range(cp))


def zigzag_order(length: int, cp: int) -> list[list[int]]:
    """The token positions each of `cp` ranks holds in the zig-zag order (`length` divisible by 2·cp)."""
    assert length % (2 * cp) == 0, (length, cp)
    c = length // (2 * cp)
    return [[*range(r * c, (r + 1) * c), *range((2 * cp - 1 - r) * c, (2 * cp - r) * c)] for r in range(cp)]
