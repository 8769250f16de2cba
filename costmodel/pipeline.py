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
- step time from per-micro-batch stage times t_i (forward + backward): one micro-batch passes every
  stage (fill and drain) and the other m − 1 follow at the pace of the slowest, T = Σ t_i + (m − 1)·max
  t_i, which is (m + p − 1)·t for equal stages, i.e. m·t·(1 + bubble). Interleaved stages run in v
  chunks: the fill and drain shrink by v, T = m·max t_i + (Σ t_i − max t_i)/v. The sends between
  stages count where the schedule waits for them (`pipeline_step_s`): in the fill and drain, and under
  1F1B wherever a run of stages is bound by the micro-batches it may hold in flight — not, as the
  closed form with the sends inside t_i would have it, twice per micro-batch (simulated 1F1B, equal
  stages: (2 − 2/p)·m + 2(p − 2) one-way transfers on the critical path, not 2(m + p − 2))."""

from __future__ import annotations

from core.levers import Schedule, lever

SCHEDULES = tuple(Schedule)
# A transformer's backward costs about twice its forward (weights' and inputs' gradients): how a stage's
# time per micro-batch splits where a schedule is simulated (`pipeline_step_s`, the timeline).
BACKWARD_SHARE = 2 / 3


def check_schedule(schedule: str, p: int, m: int, v: int = 1) -> None:
    schedule = lever(Schedule, schedule, "schedule")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"stages {p}, micro-batches {m}, chunks {v}: each must be at least 1")
    if v > 1 and schedule is not Schedule.INTERLEAVED:
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
    if schedule == Schedule.GPIPE:
        return float(m)
    if schedule == Schedule.ONE_F_ONE_B:
        return float(min(p - stage, m))
    return min(p - stage, m) * (1 + (p - 1) / (p * v))


def pipeline_step_s(schedule: str, stage_s: list[float], m: int, v: int = 1,
                    send_s: list[float] | None = None) -> float:
    """A step's time from each stage's time per micro-batch (`stage_s`: forward + backward and their
    collectives) and what crosses each stage's outgoing boundary per micro-batch (`send_s`: the
    activations forward and their gradient back; the last stage's is 0 but interleaved, where its
    chunks send on to the first stage's next). A transfer delays the stage that waits for it and
    occupies neither (`simulate`), so it counts where the schedule waits for it:

    - GPipe: once each way through the fill and drain, Σ t + Σ x + (m − 1)·max t;
    - 1F1B: the fill and drain too, and in the steady state wherever a run of stages i…j is bound by
      its micro-batches in flight: stage i starts a forward only when one of its j − i + 1 in flight has
      come back, so the pace is at least (Σ_{i..j} t + Σ_{i..j−1} x)/(j − i + 1) — with no transfers
      the slowest stage's time, the closed form above. T = Σ t + Σ x + (m − 1)·that pace: never below
      the simulated schedule's time, above it by a median 0.8% for equal stages and 1.1% for unequal
      ones, at most about 20% where a send takes as long as a stage (random draws with m ≥ p; the
      fill's transfers overlap the first stages' next forwards; `tests/test_pipeline.py`);
    - interleaved: the fill and drain (every chunk boundary once each way) while a transfer is short
      against a chunk's time (the simulation's pace stays max t up to a tenth of it); beyond that, no
      closed form is known to us: the schedule is simulated (backward twice the forward)."""
    p = len(stage_s)
    check_schedule(schedule, p, m, v)
    x = list(send_s) if send_s is not None else [0.0] * p
    if len(x) != p:
        raise ValueError(f"{len(x)} send times for {p} stages")
    slowest = max(stage_s)
    if schedule == Schedule.GPIPE:
        return sum(stage_s) + sum(x[:-1]) + (m - 1) * slowest
    if schedule == Schedule.ONE_F_ONE_B:
        pace = slowest
        for i in range(p):
            run = 0.0
            for j in range(i, p):
                run += stage_s[j] + (x[j - 1] if j > i else 0.0)
                pace = max(pace, run / (j - i + 1))
        return sum(stage_s) + sum(x[:-1]) + (m - 1) * pace
    if max(x) <= 0.1 * min(stage_s):
        return m * slowest + (sum(stage_s) - slowest) / v + sum(x)
    rows = simulate(schedule, [t * (1 - BACKWARD_SHARE) for t in stage_s], [t * BACKWARD_SHARE for t in stage_s], m,
                    v, hop_delays(x, v))
    return max(end for row in rows for *_, end in row)


def hop_delays(send_s: list[float], v: int = 1) -> list[float]:
    """`simulate`'s delays from each stage's sends per micro-batch (a round trip over its chunk
    boundaries: v of them, the last stage's v − 1): half a round trip each way, per boundary."""
    p = len(send_s)
    hops = [v - (s == p - 1) for s in range(p)]
    return [x / (2 * h) if h else 0.0 for x, h in zip(send_s, hops, strict=True)]


def p2p_bytes(boundary_elements: float, element_bytes: float) -> float:
    """Bytes sent between two consecutive stages per micro-batch: the activations forward and their
    gradient backward."""
    return 2 * boundary_elements * element_bytes


def simulate(schedule: str, forward_s: list[float], backward_s: list[float], m: int, v: int = 1,
             send_s: list[float] | None = None) -> list[list[tuple[str, int, float, float]]]:
    """When every stage runs each micro-batch's forward ("F") and backward ("B"): per stage, (kind,
    micro-batch, start, end) in its order — GPipe: every forward, then every backward; 1F1B: p − 1 − i
    forwards to fill, then one forward and one backward in turn, then the remaining backwards;
    interleaved 1F1B (v chunks per stage, each taking 1/v of the stage's time; Narayanan et al. SC'21
    §2.2.2, Megatron-LM's order): micro-batches in rounds of p, chunk after chunk, (p − 1 − i)·2 +
    (v − 1)·p forwards to fill. A forward waits for the model chunk before it (the previous stage, or
    the last stage's previous chunk), a backward for the chunk after it. `send_s[s]`: how long what
    stage s's chunk sends to the next chunk (and its gradient, back) takes to arrive, a delay on that
    dependency that occupies neither stage (the send is posted and the stage goes on, as
    torch.distributed.pipelining's isend does); 0 without."""
    p = len(forward_s)
    delay = send_s or [0.0] * p
    if len(delay) != p:
        raise ValueError(f"{len(delay)} send delays for {p} stages")
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
        if schedule == Schedule.GPIPE:
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
            # (operation waited for, its arrival delay): the chunk before (after, backward) runs on the
            # previous (next) stage, the forward of the same chunk on this one
            deps = [(("F", g - 1, i), delay[(g - 1) % p])] if kind == "F" and g > 0 else []
            if kind == "B":
                deps = [(("F", g, i), 0.0)] + ([(("B", g + 1, i), delay[g % p])] if g < last else [])
            if all(d in done for d, _ in deps):
                start = max([free[s], *(done[d] + lag for d, lag in deps)])
                end = start + (forward_s[s] if kind == "F" else backward_s[s]) / v
                done[(kind, g, i)], free[s] = end, end
                out[s].append((kind, i, start, end))
                nxt[s] += 1
                moved = True
        if not moved:
            raise RuntimeError("the schedule deadlocked")  # cannot happen for these orders
    return out
