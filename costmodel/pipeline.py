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


def simulate(schedule: str, forward_s: list[float], backward_s: list[float], m: int,
             v: int = 1) -> list[list[tuple[str, int, float, float]]]:
    """When every stage runs each micro-batch's forward ("F") and backward ("B"): per stage, (kind,
    micro-batch, start, end) in its order — GPipe: every forward, then every backward; 1F1B: p − 1 − i
    forwards to fill, then one forward and one backward in turn, then the remaining backwards;
    interleaved 1F1B (v chunks per stage, each taking 1/v of the stage's time; Narayanan et al. SC'21
    §2.2.2, Megatron-LM's order): micro-batches in rounds of p, chunk after chunk, (p − 1 − i)·2 +
    (v − 1)·p forwards to fill. A forward waits for the model chunk before it (the previous stage, or
    the last stage's previous chunk), a backward for the chunk after it."""
    p = len(forward_s)
    check_schedule(schedule, p, m, v)
    if v > 1 and m % p:
        raise ValueError(f"interleaved 1F1B runs micro-batches in rounds of the {p} stages; {m} is not a multiple")
    # Per stage, its operations in order: (kind, chunk, micro-batch).
    orders: list[list[tuple[str, int, int]]] = []
    for s in range(p):
        def op(kind: str, k: int) -> tuple[str, int, int]:  # the k-th forward or backward of this stage
            chunk = (k // p) % v
            return kind, (v - 1 - chunk if kind == "B" else chunk), (k // (p * v)) * p + k % p
        n = m * v
        if schedule == "gpipe":
            orders.append([op("F", k) for k in range(n)] + [op("B", k) for k in range(n)])
            continue
        warm = min((p - 1 - s) * 2 + (v - 1) * p if v > 1 else p - 1 - s, n)
        order = [op("F", k) for k in range(warm)]
        f, b = warm, 0
        while b < n:
            if f < n:
                order.append(op("F", f))
                f += 1
            order.append(op("B", b))
            b += 1
        orders.append(order)
    last = p * v - 1  # the last model chunk (global stage chunk·p + s)
    done: dict[tuple[str, int, int], float] = {}  # (kind, global chunk, micro-batch) → end
    out: list[list[tuple[str, int, float, float]]] = [[] for _ in range(p)]
    free = [0.0] * p
    nxt = [0] * p
    while any(nxt[s] < len(orders[s]) for s in range(p)):
        moved = False
        for s in range(p):
            if nxt[s] == len(orders[s]):
                continue
            kind, chunk, i = orders[s][nxt[s]]
            g = chunk * p + s
            deps = [("F", g - 1, i)] if kind == "F" and g > 0 else []
            if kind == "B":
                deps = [("F", g, i)] + ([("B", g + 1, i)] if g < last else [])
            if all(d in done for d in deps):
                start = max([free[s], *(done[d] for d in deps)])
                end = start + (forward_s[s] if kind == "F" else backward_s[s]) / v
                done[(kind, g, i)], free[s] = end, end
                out[s].append((kind, i, start, end))
                nxt[s] += 1
                moved = True
        if not moved:
            raise RuntimeError("the schedule deadlocked")  # cannot happen for these orders
    return out
