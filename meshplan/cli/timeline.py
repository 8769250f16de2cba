"""A pipelined plan's schedule drawn as a timeline: one row per stage, forward and backward blocks per
micro-batch (each chunk's, interleaved; `costmodel.pipeline.simulate`), the bubble where a row is idle."""

from __future__ import annotations

from pathlib import Path

from core.errors import MeshplanError
from costmodel.pipeline import BACKWARD_SHARE, hop_delays, simulate
from planner.strategy import Strategy


def draw_timeline(strategy: Strategy, path: str | Path) -> float:
    """Writes the PNG; returns the simulated pipeline time (s)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pl = strategy.pipeline
    if pl is None:
        raise MeshplanError("--timeline draws a pipeline's schedule, and this plan has no stages; plan with pp in --layout")
    m, v = strategy.training.micro_batches, pl.virtual_stages
    times = [st.time_s for st in pl.stages]
    try:
        rows = simulate(pl.schedule, [t * (1 - BACKWARD_SHARE) for t in times], [t * BACKWARD_SHARE for t in times],
                        m, v, hop_delays([st.send_s for st in pl.stages], v))
    except ValueError as e:
        raise MeshplanError(f"--timeline: {e}") from e
    end = max(e for row in rows for _, _, _, e in row)
    fig, ax = plt.subplots(figsize=(12, 0.5 * len(rows) + 1.5))
    for s, row in enumerate(rows):
        for kind, _, start, stop in row:
            ax.barh(s, (stop - start) * 1e3, left=start * 1e3, color="tab:blue" if kind == "F" else "tab:orange",
                    edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(rows)), [f"stage {s}" for s in range(len(rows))])
    ax.invert_yaxis()
    ax.set_xlabel("ms (forward blue, backward orange; white: the bubble)")
    chunks = f", {v} chunks per stage" if v > 1 else ""
    ax.set_title(f"{strategy.model.name}: {pl.schedule}{chunks}, {len(rows)} stages × {m} micro-batches, "
                 f"{end * 1e3:.1f} ms, bubble {pl.bubble_fraction:.1%} of compute")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return end
