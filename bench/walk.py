"""One walk of a strategy through `executor.train.run_rank`: the files of meshplan's own code it passes
through, each function followed the first time it is called (depth first), on rank 0 of a 2-rank gloo
run of one warm-up and one timed step. A stay is a run of calls in one file; a climb, a return to the
caller's file; a return to a visited file, a stay in a file entered before.

    python -m bench.walk STRATEGY MODEL     # from the repository root; one JSON line

Run from another checkout's root (PYTHONPATH=. python PATH/TO/bench/walk.py …) it walks that code."""
import json
import os
import socket
import sys

import torch.multiprocessing as mp

OWN = ("core", "planner", "costmodel", "hwprofiles", "executor", "meshplan", "bench")

def rank(r, port, strategy_path, model, out):
    import torch.distributed as dist
    sys.path.insert(0, os.getcwd())
    try:
        from executor.preflight import RunOptions
    except ImportError:  # a checkout from before executor/preflight.py (db96aa9 and earlier)
        from executor.train import RunOptions
    from executor.train import run_rank
    from planner.strategy import load_strategy
    root = os.getcwd() + os.sep
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2)
    s = load_strategy(strategy_path)
    seq, seen, stack = [], set(), []
    def rel(code):
        f = code.co_filename
        if not f.startswith(root):
            return None
        p = f[len(root):]
        return p if p.split(os.sep)[0] in OWN else None
    def prof(frame, event, arg):
        if event == "call":
            p = rel(frame.f_code)
            key = (p, frame.f_code.co_firstlineno, frame.f_code.co_name)
            first = p is not None and key not in seen
            if first:
                seen.add(key)
                seq.append(("enter", p, frame.f_code.co_name))
            stack.append((first, p))
        elif event == "return" and stack:
            first, p = stack.pop()
            if first:
                caller = next((q for f, q in reversed(stack) if f), None)
                if caller is not None and caller != p:
                    seq.append(("return", caller, ""))
    if r == 0:
        sys.setprofile(prof)
    run_rank(s, model, RunOptions(steps=1, warmup=1))
    sys.setprofile(None)
    if r == 0:
        stays: list[str] = []
        visited: set[str] = set()
        revisits = climbs = 0
        for kind, p, _ in seq:
            if not stays or stays[-1] != p:
                if p in visited:
                    revisits += 1
                visited.add(p)
                stays.append(p)
                climbs += kind == "return"
        out.put({"stays": len(stays), "files": len(visited), "climbs": climbs, "returns_to_a_visited_file": revisits,
                 "functions": len(seen), "by_file": {f: stays.count(f) for f in sorted(visited)}})
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=rank, args=(r, port, sys.argv[1], sys.argv[2], q)) for r in range(2)]
    for p in ps:
        p.start()
    print(json.dumps(q.get(timeout=600)))
    for p in ps:
        p.join()
