"""Context parallelism's ring design, as the planner, the cost model and the executor name it.

On an axis named `cp` an attention chain (`costmodel/attention.py`: q·kᵀ → [+ mask] → softmax → ·v)
whose queries are split on their tokens may hold its keys and values split too: each rank computes its
queries against the block of keys and values it holds, passes that block to the next rank of the ring
and takes the previous rank's, cp times, merging the blocks' softmaxes as they come (ring attention).
Its two products then carry the kernel `RING` on the cp axis, with kᵀ split on its tokens (its last
dim) and v on its tokens (its second-to-last) there (`planner/rules/context.py`); without it they read
kᵀ and v whole there (gathered: the all-gather design).
"""

from __future__ import annotations

from core.mesh import DeviceMesh

RING = "ring_attention"
CP_AXIS = "cp"


def cp_axis(mesh: DeviceMesh) -> int | None:
    """The mesh's context-parallel axis (named `cp`, more than one rank), if any."""
    return next((a for a, n in enumerate(mesh.axis_names) if n == CP_AXIS and mesh.shape[a] > 1), None)
