"""Pipeline parallelism's closed forms (Narayanan et al. SC'21 §2.2; Korthikanti et al. 2022 §4) and a
pipelined step's time from its stages' times.

p stages, m micro-batches per step, v model chunks per device (interleaved 1F1B; 1 otherwise):
- bubble fraction (idle time over ideal compute time): GPipe and 1F1B (p − 1)/m, interleaved
  (p − 1)/(v·m);
- micro-batches of activations a stage holds at its peak: GPipe all m (every forward runs before any
  backward); 1F1B min(p − i, m) at stage i (the first holds p); interleaved 1F1B the first stage
  p·(1 + (p − 1)/(p·v)) micro-batches' worth of one stage's activations (Korthikanti et al. §4.2.3),
  the later ones in proportion, (p − i)·(1 + (p − 1)/(p·v)), at most m·(1 + …);
- point-to-point between consecutive stages per micro-batch: the boundary activations forward and
  their gradient backward (B·s·h elements each for a transformer);
- step time from per-micro-batch stage times t_i (forward + backward, its sends included): one
  micro-batch passes every stage (fill and drain) and the other m − 1 follow at the pace of the slowest,
  T = Σ t_i + (m − 1)·max t_i, which is (m + p − 1)·t for equal stages, i.e. m·t·(1 + bubble). Interleaved
  stages run in v chunks: the fill and drain shrink by v, T = m·max t_i + (Σ t_i − max t_i)/v."""

from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def check_schedule(schedule: str, p: int, m: int, v: int = 1) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"stages {p}, micro-batches {m}, chunks {v}: each must be at least 1")
    if v > 1 and schedule != "interleaved":
        raise ValueError(f"{v} chunks per device need the interleaved schedule, not {schedule}")


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle time of a pipeline step over its ideal (bubble-free) compute time."""
    check_schedule(schedule, p, m, v)
    return (p - 1) / (v * m)


def in_flight(schedule: str, p: int, m: int, stage: int, v: int = 1) -> float:
    """Micro-batches' worth of one stage's activations that stage `stage` (0-based) holds at its peak."""
    check_schedule(schedule, p, m, v)
    if not 0 <= stage < p:
        raise ValueError(f"stage {stage} of {p}")
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(p - stage, m))
    return min(p - stage, m) * (1 + (p - 1) / (p * v))


def pipeline_step_s(schedule: str, stage_s: list[float], m: int, v: int = 1) -> float:
    """A step's time from each stage's time per micro-batch (forward + backward + its sends)."""
    p = len(stage_s)
    check_schedule(schedule, p, m, v)
    slowest = max(stage_s)
    return m * slowest + (sum(stage_s) - slowest) / v


def p2p_bytes(boundary_elements: float, element_bytes: float) -> float:
    """Bytes sent between two consecutive stages per micro-batch: the activations forward and their
    gradient backward."""
    return 2 * boundary_elements * element_bytes


def simulate(schedule: str, forward_s: list[float], backward_s: list[float], m: int) -> list[list[tuple[str, int, float, float]]]:
    """When every stage runs each micro-batch's forward ("F") and backward ("B"): per stage, (kind,
    micro-batch, start, end) in its order — GPipe: every forward, then every backward; 1F1B: p − 1 − i
    forwards to fill, then one forward and one backward in turn, then the remaining backwards. A
    forward waits for the previous stage's, a backward for the next stage's. (Interleaved chunks are
    not simulated.)"""
    p = len(forward_s)
    check_schedule(schedule, p, m)
    if schedule == "interleaved":
        raise ValueError("the interleaved schedule is not simulated")
    orders: list[list[tuple[str, int]]] = []
    for s in range(p):
        if schedule == "gpipe":
            orders.append([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
            continue
        warm = min(p - 1 - s, m)
        order = [("F", i) for i in range(warm)]
        f, b = warm, 0
        while b < m:
            if f < m:
                order.append(("F", f))
                f += 1
            order.append(("B", b))
            b += 1
        orders.append(order)
    done: dict[tuple[str, int, int], float] = {}
    out: list[list[tuple[str, int, float, float]]] = [[] for _ in range(p)]
    free = [0.0] * p
    nxt = [0] * p
    while any(nxt[s] < len(orders[s]) for s in range(p)):
        moved = False
        for s in range(p):
            if nxt[s] == len(orders[s]):
                continue
            kind, i = orders[s][nxt[s]]
            deps = [("F", s - 1, i)] if kind == "F" and s > 0 else []
            if kind == "B":
                deps = [("F", s, i)] + ([("B", s + 1, i)] if s < p - 1 else [])
            if all(d in done for d in deps):
                start = max([free[s], *(done[d] for d in deps)])
                end = start + (forward_s[s] if kind == "F" else backward_s[s])
                done[(kind, s, i)], free[s] = end, end
                out[s].append((kind, i, start, end))
                nxt[s] += 1
                moved = True
        if not moved:
            raise RuntimeError("the schedule deadlocked")  # cannot happen for these orders
    return out
