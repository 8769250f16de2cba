"""What offloading to host memory costs on one GPU machine, measured for pricing it (issue 35): the
host link, the optimizer on the host, and whole FSDP2 steps with and without `CPUOffloadPolicy`.

    OUT=dir python bench/gpu/measure_offload.py        # writes dir/offload.json, prints a summary

- `copy`: pinned host ↔ device copies by size (CUDA events), one direction at a time and both at once
  (two streams), and a pageable host → device copy beside them;
- `adamw_cpu`: `torch.optim.AdamW` stepping fp32 parameters held in host memory (foreach and fused),
  by parameter count, on the machine's CPU threads (what FSDP2's CPU offload runs);
- `steps`: a Llama-shaped model (transformers config, random weights) trained with `fully_shard` per
  block and on the root on a 1-GPU mesh, bf16 compute / fp32 reduction (`MixedPrecisionPolicy`), fused
  AdamW on the device against `CPUOffloadPolicy(pin_memory=True)` with AdamW on the host: step time,
  the optimizer step's share, peak device memory.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

OUT = Path(os.environ.get("OUT", "."))


def _events_ms(fn: Any, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def copies() -> list[dict[str, Any]]:
    rows = []
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    for log2 in (20, 22, 24, 26, 28, 30):
        n = 2**log2
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        back = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        dev2 = torch.empty(n, dtype=torch.uint8, device="cuda")
        pageable = torch.empty(n, dtype=torch.uint8)

        def both() -> None:
            with torch.cuda.stream(s1):
                dev.copy_(host, non_blocking=True)
            with torch.cuda.stream(s2):
                back.copy_(dev2, non_blocking=True)
            torch.cuda.current_stream().wait_stream(s1)
            torch.cuda.current_stream().wait_stream(s2)

        row = {"bytes": n,
               "h2d_s": _events_ms(lambda: dev.copy_(host, non_blocking=True)) / 1e3,
               "d2h_s": _events_ms(lambda: back.copy_(dev, non_blocking=True)) / 1e3,
               "both_s": _events_ms(both) / 1e3,
               "h2d_pageable_s": _events_ms(lambda: dev.copy_(pageable), reps=3) / 1e3}
        rows.append(row)
        print(f"copy {n / 2**20:8.0f} MiB: h2d {n / row['h2d_s'] / 1e9:6.1f} GB/s, d2h {n / row['d2h_s'] / 1e9:6.1f}, "
              f"both {2 * n / row['both_s'] / 1e9:6.1f} (sum), pageable h2d {n / row['h2d_pageable_s'] / 1e9:6.1f}",
              flush=True)
        del host, back, dev, dev2, pageable
    return rows


def adamw_cpu() -> list[dict[str, Any]]:
    rows = []
    for params in (2**24, 2**26, 2**28):
        tensors = [torch.nn.Parameter(torch.randn(params // 64)) for _ in range(64)]
        for p in tensors:
            p.grad = torch.randn_like(p)
        for impl in ("foreach", "fused"):
            opt = torch.optim.AdamW(tensors, lr=1e-4, **{impl: True})
            opt.step()  # states made
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                opt.step()
                times.append(time.perf_counter() - t0)
            row = {"params": params, "tensors": 64, "impl": impl, "threads": torch.get_num_threads(),
                   "step_s": statistics.median(times)}
            rows.append(row)
            print(f"adamw cpu {impl:7s} {params / 1e6:6.0f} M params: {row['step_s'] * 1e3:8.1f} ms "
                  f"({row['step_s'] / params * 1e9:.2f} ns/param, {torch.get_num_threads()} threads)", flush=True)
            del opt
        del tensors
    return rows


def steps() -> list[dict[str, Any]]:
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1)
    mesh = init_device_mesh("cuda", (1,))
    raw = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16,
           "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 4096}
    batch, seq = 4, 2048
    rows = []
    for offload in (False, True):
        torch.manual_seed(0)
        config = transformers.AutoConfig.for_model("llama", **raw)
        config._attn_implementation = "sdpa"
        model = transformers.AutoModelForCausalLM.from_config(config)
        n = sum(p.numel() for p in model.parameters())
        policy = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                      offload_policy=CPUOffloadPolicy(pin_memory=True) if offload else None)
        policy = {k: v for k, v in policy.items() if v is not None}
        if not offload:
            model = model.cuda()
        for block in model.model.layers:
            fully_shard(block, mesh=mesh, **policy)
        fully_shard(model, mesh=mesh, **policy)
        for m in model.modules():  # buffers (rotary frequencies) stay on the device: offload moves parameters
            for k, b in m._buffers.items():
                if b is not None:
                    m._buffers[k] = b.cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # on the host where offloaded
        ids = torch.randint(0, raw["vocab_size"], (batch, seq), device="cuda")
        torch.cuda.reset_peak_memory_stats()
        times, opt_times = [], []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            opt_times.append(time.perf_counter() - t1)
        row = {"model": raw, "params": n, "batch": batch, "seq": seq, "offload": offload,
               "step_s": statistics.median(times[2:]), "optimizer_s": statistics.median(opt_times[2:]),
               "peak_bytes": torch.cuda.max_memory_allocated(), "threads": torch.get_num_threads()}
        rows.append(row)
        print(f"step {n / 1e9:.2f} B params, {batch}x{seq}, mixed, offload={offload}: {row['step_s'] * 1e3:.1f} ms "
              f"(optimizer {row['optimizer_s'] * 1e3:.1f} ms), peak {row['peak_bytes'] / 2**30:.2f} GiB", flush=True)
        del model, opt, ids
        torch.cuda.empty_cache()
    dist.destroy_process_group()
    return rows


def main() -> None:
    import traceback

    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "cpu_threads": torch.get_num_threads()}
    OUT.mkdir(parents=True, exist_ok=True)
    for name, fn in (("copy", copies), ("adamw_cpu", adamw_cpu), ("steps", steps)):
        try:  # each part on its own: one failing keeps the others' figures
            result[name] = fn()
        except Exception as e:
            traceback.print_exc(limit=3)
            result[name] = {"error": f"{type(e).__name__}: {e}"}
        (OUT / "offload.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
