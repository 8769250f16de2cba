"""Communication time of collectives over mesh axes, α-β per link level from the profile.

A group over mesh axes that stays inside a node is priced at the intra-node level. A group that spans
nodes with g > 1 of its devices per node is hierarchical (as NCCL does it for all-reduce):
  all_reduce      reduce_scatter inside (g, S) + all_reduce across (n/g, S/g) + all_gather inside (g, S)
  all_gather      all_gather across (n/g, S/g) + all_gather inside (g, S)
  reduce_scatter  reduce_scatter inside (g, S) + reduce_scatter across (n/g, S/g)
  all_to_all      max(all_to_all inside (g, S·g/n), all_to_all across (n/g, S)): of its S bytes a rank
                  sends (g−1)/n to its node's peers and (n−g)/n to other nodes, over both links at once
                  (each GPU with its own NIC), as expert parallelism's dispatch and combine run
and the rest (broadcast, send/recv) run flat at the inter-node level.
"""

from __future__ import annotations

from core.collectives import Collective, LinkLevel, PricedCollective, Purpose
from core.graph import TensorKind
from core.mesh import DeviceMesh
from core.placement import Spec, gradient_spec
from costmodel.device import link_collective_time_s
from hwprofiles.profile import HardwareProfile


def collective_time_s(profile: HardwareProfile, mesh: DeviceMesh, kind: Collective, size_bytes: float,
                      axes: tuple[int, ...]) -> float:
    n = mesh.group_size(axes)
    if n <= 1 or size_bytes <= 0:
        return 0.0
    level = mesh.level(axes)
    if level is LinkLevel.INTRA_NODE:
        return link_collective_time_s(profile, kind, size_bytes, n, level)
    g = mesh.inner_group_size(axes)
    if g > 1 and kind is Collective.ALL_TO_ALL:
        return max(link_collective_time_s(profile, kind, size_bytes * g / n, g, LinkLevel.INTRA_NODE),
                   link_collective_time_s(profile, kind, size_bytes, n // g, LinkLevel.INTER_NODE))
    if g <= 1 or kind not in (Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
        return link_collective_time_s(profile, kind, size_bytes, n, LinkLevel.INTER_NODE)
    inner, outer = LinkLevel.INTRA_NODE, LinkLevel.INTER_NODE
    m = n // g

    def t(kind: Collective, size_bytes: float, n: int, level: LinkLevel) -> float:
        return link_collective_time_s(profile, kind, size_bytes, n, level)

    if kind is Collective.ALL_REDUCE:
        return (t(Collective.REDUCE_SCATTER, size_bytes, g, inner) + t(Collective.ALL_REDUCE, size_bytes / g, m, outer)
                + t(Collective.ALL_GATHER, size_bytes, g, inner))
    if kind is Collective.ALL_GATHER:
        return t(Collective.ALL_GATHER, size_bytes / g, m, outer) + t(Collective.ALL_GATHER, size_bytes, g, inner)
    return t(Collective.REDUCE_SCATTER, size_bytes, g, inner) + t(Collective.REDUCE_SCATTER, size_bytes / g, m, outer)


def seen_reduction(e: PricedCollective, reduced: set[tuple[str, tuple[int, ...]]]) -> bool:
    """A tensor read by several consumers sums their partial gradients first and reduces once per
    axis (autograd accumulates, then one all-reduce): later consumers' reductions are the same one."""
    if e.purpose not in (Purpose.GRAD_SYNC, Purpose.GRAD_REDUCE_SCATTER):
        return False
    key = (e.tensor, e.axes)
    if key in reduced:
        return True
    reduced.add(key)
    return False


def shared_reshard(tensor: str, kind: TensorKind, have: Spec, need: Spec, consumer_split: frozenset[int],
                   segment: object) -> tuple[object, ...] | None:
    """The key under which an activation's redistribute runs once for all the consumers that need it in
    the same spec with the same gradient placements (`gradient_spec`) within one repeated layer
    (`segment`: the consumer's layer, `OpGraph.layer_of`; None outside the layers): what the executor
    does (one redistribute, the consumers' gradients summed before its backward) and what torchtitan's
    `PrepareModuleInput` does for q, k and v. Per layer, because a recomputed layer redistributes anew
    and a pipeline's stages each their own. None for what is not redistributed once so: parameters
    (gathered per use, `states.py`), inputs and constants, and a tensor already where it is needed."""
    if kind is not TensorKind.ACTIVATION or have == need:
        return None
    return tensor, have, need, gradient_spec(need, consumer_split), segment
