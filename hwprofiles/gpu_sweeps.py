"""`profile calibrate` on a GPU: the device's microbenchmarks, sized from the device, written as a
measurement file (the format `calibrate --from` reads, `measured.py`) and fitted by the same fits, so
a profile measured here and one fitted from someone else's file come out of one piece of code.

What is measured (`measure`), each a median of CUDA-event timings after warm-up (`CudaTimer`):
- square GEMMs in bf16 from 256, doubling (with the sizes half-way between), until one is at least
  8192 and takes at least 1 ms (`saturating_sizes`); fp32 squares as far;
- transformer GEMM shapes (tokens × hidden, × 3·hidden, × the MLP's width and back) and dims that
  are not multiples of 8/64/128: LM heads of 50257 and 32001 beside 50304 and 32000, k or n of 4095,
  4100, 4104;
- element-wise ops by type, forward and forward + backward, in bf16 from 2^16 elements, ×16, then
  doubling past 2^26 until an add's rate is flat; fp32 at the largest size;
- scaled_dot_product_attention (FlashAttention on Hopper) by sequence, head dim, grouped heads and
  causality, forward and forward + backward;
- cross-entropy from bf16 and fp32 logits; embedding lookups; fused and foreach AdamW by parameters
  and tensors, as far as a fifth of the device's memory holds; a one-element kernel's launch.

Which sizes are run is decided here, how one is timed by the timer: a test answers from a file
(a fake H100) and checks the sweep reaches the saturated region without a GPU."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any, Protocol

# The matmul sweep grows from here until it saturates (`saturating_sizes`); element-wise ops from
# 2^16 elements to at least this many (past every cache, each call a few hundred µs on an H100).
GPU_MATMUL_START, GPU_MATMUL_MIN, GPU_MATMUL_MAX, GPU_MATMUL_MIN_S = 256, 8192, 32768, 1e-3
GPU_ELEMENTS = 1 << 26


def saturating_sizes(time_s: Callable[[int], float], *, start: int = GPU_MATMUL_START, min_size: int = GPU_MATMUL_MIN,
                     min_time_s: float = GPU_MATMUL_MIN_S, max_size: int = GPU_MATMUL_MAX) -> list[int]:
    """Square matmul sizes from `start`, doubling, until one is at least `min_size` and takes at least
    `min_time_s` a call (`time_s(n)`: one n³ matmul), or `max_size`: a device's curve up to where it
    saturates, not a CPU's fixed sizes (on an H100 those stop at 0.9 GFLOP, 18 µs, all launch)."""
    sizes, n = [], start
    while True:
        sizes.append(n)
        if (n >= min_size and time_s(n) >= min_time_s) or n >= max_size:
            return sizes
        n *= 2


DTYPES = ("bf16", "fp32")
# The element-wise ops a transformer's step runs, as the measurement file names them (`measured.py`'s
# ELEMENTWISE_OPS maps them to ONNX op types).
ELEMENTWISE = ("add", "mul", "gelu_tanh", "gelu_erf", "silu", "exp", "tanh", "softmax", "layer_norm",
               "rms_norm_eager", "rms_norm_fused", "dropout", "swiglu", "cast_to_fp32")
# (hidden, MLP width) of GPT-2-124M, Llama-3.2-1B, Llama-3-8B.
HIDDEN = ((768, 3072), (2048, 8192), (4096, 14336))
# (hidden, vocabulary) of LM heads, aligned and not.
HEADS = ((768, 50257), (768, 50304), (4096, 32000), (4096, 32001), (2048, 128256))  # at 16384 tokens
# k or n off alignment by one element, by 4, 8 and 16 bytes of bf16.
UNALIGNED = ((8192, 4096, 4095), (8192, 4095, 4096), (8191, 4096, 4096), (8192, 4100, 4096), (8192, 4104, 4096),
             (8192, 4112, 4096))
# (batch, heads, kv heads, sequence, head dim): 16k tokens or more a call, sequence 512–16384.
ATTENTION = ((16, 12, 12, 1024, 64), (8, 16, 16, 1024, 64), (4, 32, 32, 2048, 64), (4, 32, 8, 2048, 64),
             (2, 32, 8, 4096, 128), (1, 32, 8, 8192, 128), (1, 64, 8, 8192, 128), (8, 32, 32, 512, 128),
             (1, 32, 32, 16384, 128))
CROSS_ENTROPY = ((16384, 50257), (16384, 50304), (8192, 128256), (4096, 32000), (8192, 151936))
EMBEDDING = ((16384, 50257, 768), (8192, 128256, 2048), (8192, 128256, 4096))
ADAMW = ((10**7, 10), (10**8, 100), (5 * 10**8, 200), (10**9, 300), (2 * 10**9, 300))
ELEMENTWISE_MAX = 1 << 28
SATURATED = 1.9  # time at twice the elements over time: the rate within 5% of flat


class KernelTimer(Protocol):
    """Seconds of one call of each kernel the sweep measures (`CudaTimer` on a GPU)."""

    def info(self) -> dict[str, Any]: ...  # device, torch, sm_count, memory_bytes

    def launch(self) -> float: ...

    def gemm(self, m: int, n: int, k: int, dtype: str) -> float: ...

    def elementwise(self, op: str, dtype: str, numel: int) -> tuple[float, float]: ...  # forward, fwd + bwd

    def attention(self, batch: int, heads: int, kv_heads: int, seq: int, head_dim: int,
                  causal: bool) -> tuple[float, float]: ...

    def cross_entropy(self, tokens: int, vocab: int, dtype: str) -> float: ...

    def embedding(self, tokens: int, vocab: int, hidden: int) -> float: ...

    def adamw(self, params: int, tensors: int, impl: str) -> float: ...


def measure(timer: KernelTimer, *, quick: bool = False,
            progress: Callable[[str], None] = lambda _what: None) -> dict[str, Any]:
    """The measurement file (a dict; `measured.load_measurements`'s format) of the device behind `timer`."""
    info = timer.info()
    out: dict[str, Any] = {**{k: v for k, v in info.items() if k != "memory_bytes"},
                           "notes": "median of CUDA-event timings after warm-up; seconds; fwd_bwd = forward + "
                                    "backward of one call; sizes from the device (meshplan profile calibrate)"}
    out["launch_s"] = timer.launch()
    out["matmul"] = _gemms(timer, quick)
    progress("GEMMs")
    out["elementwise"] = _elementwise(timer, quick)
    progress("element-wise ops")
    out["attention_sdpa"] = []
    for b, h, kvh, s, d in ATTENTION[::2] if quick else ATTENTION:
        for causal in (True, False):
            fw, fb = timer.attention(b, h, kvh, s, d, causal)
            flops = 4 * b * h * s * s * d * (0.5 if causal else 1)
            out["attention_sdpa"].append({"batch": b, "heads": h, "kv_heads": kvh, "seq": s, "head_dim": d,
                                          "causal": causal, "fwd_s": fw, "fwd_bwd_s": fb,
                                          "fwd_tflops": flops / fw / 1e12, "fwd_bwd_tflops": 3.5 * flops / fb / 1e12})
    progress("attention")
    out["cross_entropy"] = [{"tokens": t, "vocab": v, "logits_dtype": dt, "upcast_to_fp32": dt == "bf16",
                             "fwd_bwd_s": timer.cross_entropy(t, v, dt)} for t, v in CROSS_ENTROPY for dt in DTYPES]
    out["embedding"] = [{"tokens": t, "vocab": v, "hidden": h, "dtype": "fp32", "fwd_bwd_s": timer.embedding(t, v, h)}
                        for t, v, h in EMBEDDING]
    room = info.get("memory_bytes", 80 << 30) / 5  # params, gradients and two states in fp32: 16 bytes each
    out["adamw"] = [{"params": p, "tensors": n, "impl": impl, "step_s": timer.adamw(p, n, impl)}
                    for p, n in ADAMW if 16 * p <= room for impl in ("fused", "foreach")]
    progress("losses and the optimizer")
    return out


def _gemms(timer: KernelTimer, quick: bool) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    seen: dict[tuple[int, int, int, str], float] = {}

    def run(m: int, n: int, k: int, dtype: str) -> float:
        if (m, n, k, dtype) not in seen:
            s = seen[m, n, k, dtype] = timer.gemm(m, n, k, dtype)
            rows.append({"m": m, "n": n, "k": k, "dtype": dtype, "s": s, "tflops": 2 * m * n * k / s / 1e12})
        return seen[m, n, k, dtype]

    squares = saturating_sizes(lambda n: run(n, n, n, "bf16"))
    between = [n + n // 2 for n in squares[1:-1]]
    for n in squares + between:  # the sizing probes only sizes past `min_size`
        run(n, n, n, "bf16")
    for n in sorted(squares + between):  # fp32 as far as bf16 saturated (fp32 saturates sooner)
        run(n, n, n, "fp32")
    for h, f in HIDDEN[:2]:  # and on transformer shapes, which squares alone fit 11% off
        for n, k in ((h, h), (3 * h, h), (f, h), (h, f)):
            run(2048, n, k, "fp32")
    tokens = (8192,) if quick else (2048, 8192)
    for t in tokens:
        for h, f in HIDDEN:
            for n, k in ((h, h), (3 * h, h), (f, h), (h, f)):
                run(t, n, k, "bf16")
    for h, v in HEADS:
        run(16384, v, h, "bf16")
    for m, n, k in UNALIGNED:
        run(m, n, k, "bf16")
    return rows


def _elementwise(timer: KernelTimer, quick: bool) -> list[dict[str, Any]]:
    """bf16 at 2^16, 2^20, 2^24 and 2^26 elements, then doubling until an add takes twice as long at
    twice the size (within `SATURATED`: past the launch-bound sizes and the L2, the rate flat); fp32 at
    the largest (not quick)."""
    sizes = [1 << 16, 1 << 20, 1 << 24, GPU_ELEMENTS]
    while sizes[-1] < ELEMENTWISE_MAX:
        sizes.append(2 * sizes[-1])
        if timer.elementwise("add", "bf16", sizes[-1])[0] >= SATURATED * timer.elementwise("add", "bf16", sizes[-2])[0]:
            break
    rows = []
    for dtype in ("bf16",) if quick else DTYPES:
        for numel in sizes if dtype == "bf16" else sizes[-1:]:
            hidden = 4096 if numel >= 1 << 20 else 1024
            for op in ELEMENTWISE:
                fw, fb = timer.elementwise(op, dtype, numel)
                element = 2 if dtype == "bf16" else 4
                moved = 3 if op in ("add", "mul", "swiglu") else 2
                rows.append({"op": op, "dtype": dtype, "numel": numel, "shape": [numel // hidden, hidden],
                             "fwd_s": fw, "fwd_bwd_s": fb, "fwd_GBps_min_traffic": moved * numel * element / fw / 1e9})
    return rows


class CudaTimer:
    """Each kernel on one CUDA device: CUDA events around each of `repeats` calls after `warmup`,
    the median; TF32 off (fp32 GEMMs as fp32). GEMMs and attention are timed on a hot device, after
    `heat_s` of 8192³ GEMMs (`START_HEAT_S` before the first): a training step keeps the GPU busy at
    the clock its power limit allows, and a kernel timed after an idle gap runs at the boost clock —
    on an H100, transformer GEMMs 9–17% faster than after 3 s of load (SM clock 1395 MHz then).
    torch is imported here, on the device that measures."""

    START_HEAT_S = 3.0
    SETTLE_S = 0.03

    def __init__(self, device: Any, *, repeats: int = 15, warmup: int = 4, heat_s: float = 0.2) -> None:
        import torch

        self.torch, self.device, self.repeats, self.warmup, self.heat_s = torch, device, repeats, warmup, heat_s
        torch.backends.cuda.matmul.allow_tf32 = False
        self.dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
        self._cache: dict[tuple[Any, ...], tuple[float, float]] = {}
        self._heater = [torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2)]
        self._heat(self.START_HEAT_S)

    def _heat(self, seconds: float) -> None:
        """The device under load for `seconds` (its clock where a step's load holds it)."""
        import time

        a, b = self._heater
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(4):
                a @ b
            self.torch.cuda.synchronize(self.device)

    def info(self) -> dict[str, Any]:
        props = self.torch.cuda.get_device_properties(self.device)
        return {"device": self.torch.cuda.get_device_name(self.device), "torch": self.torch.__version__,
                "sm_count": props.multi_processor_count, "memory_bytes": props.total_memory}

    def _time(self, fn: Callable[[], object], repeats: int | None = None, warmup: int | None = None, *,
              heat: bool = False) -> float:
        """Median seconds of `fn`: after `heat_s` of load where `heat` (compute-bound kernels, whose
        clock the load sets), then `warmup` calls and at least `SETTLE_S` of them (the clock settled
        to this kernel's load), then `repeats` calls each between two CUDA events."""
        import time

        cuda = self.torch.cuda
        if heat:
            self._heat(self.heat_s)
        t0 = time.perf_counter()
        while True:
            for _ in range(self.warmup if warmup is None else warmup):
                fn()
            cuda.synchronize(self.device)
            if time.perf_counter() - t0 >= self.SETTLE_S:
                break
        times = []
        for _ in range(repeats or self.repeats):
            start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            cuda.synchronize(self.device)
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    def _free(self) -> None:
        """The previous kernel's tensors back to the device (each measurement starts with it)."""
        import gc

        gc.collect()
        self.torch.cuda.empty_cache()

    def launch(self) -> float:
        tiny = self.torch.ones(1, device=self.device)
        return self._time(lambda: tiny + 1, repeats=50, warmup=10)

    def gemm(self, m: int, n: int, k: int, dtype: str) -> float:
        self._free()
        a = self.torch.randn(m, k, device=self.device, dtype=self.dtypes[dtype])
        b = self.torch.randn(k, n, device=self.device, dtype=self.dtypes[dtype])
        s = self._time(lambda: a @ b, heat=True)
        return s

    def elementwise(self, op: str, dtype: str, numel: int) -> tuple[float, float]:
        key = (op, dtype, numel)
        if key not in self._cache:
            self._cache[key] = self._elementwise(op, dtype, numel)
        return self._cache[key]

    def _elementwise(self, op: str, dtype: str, numel: int) -> tuple[float, float]:
        self._free()
        torch = self.torch
        import torch.nn.functional as F

        def rms_norm(x: Any, w: Any) -> Any:
            return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * w

        fns: dict[str, Callable[[Any, Any, Any], Any]] = {
            "add": lambda x, y, w: x + y, "mul": lambda x, y, w: x * y,
            "gelu_tanh": lambda x, y, w: F.gelu(x, approximate="tanh"), "gelu_erf": lambda x, y, w: F.gelu(x),
            "silu": lambda x, y, w: F.silu(x), "exp": lambda x, y, w: torch.exp(x), "tanh": lambda x, y, w: torch.tanh(x),
            "softmax": lambda x, y, w: torch.softmax(x, -1), "layer_norm": lambda x, y, w: F.layer_norm(x, x.shape[-1:], w),
            "rms_norm_eager": lambda x, y, w: rms_norm(x, w), "rms_norm_fused": lambda x, y, w: F.rms_norm(x, x.shape[-1:], w),
            "dropout": lambda x, y, w: F.dropout(x, 0.1), "swiglu": lambda x, y, w: F.silu(x) * y,
            "cast_to_fp32": lambda x, y, w: x.float(),
        }
        f = fns[op]
        hidden = 4096 if numel >= 1 << 20 else 1024
        shape = (numel // hidden, hidden)
        dt = self.dtypes[dtype]
        x = torch.randn(shape, device=self.device, dtype=dt, requires_grad=True)
        y = torch.randn(shape, device=self.device, dtype=dt, requires_grad=True)
        w = torch.ones(hidden, device=self.device, dtype=dt, requires_grad=True)
        with torch.no_grad():
            fw = self._time(lambda: f(x, y, w))
        g = torch.randn_like(f(x, y, w))

        def fwd_bwd() -> None:
            f(x, y, w).backward(g)

        fb = self._time(fwd_bwd)
        return fw, fb

    def attention(self, batch: int, heads: int, kv_heads: int, seq: int, head_dim: int,
                  causal: bool) -> tuple[float, float]:
        self._free()
        torch = self.torch
        import torch.nn.functional as F

        def t(h: int) -> Any:
            return torch.randn(batch, h, seq, head_dim, device=self.device, dtype=torch.bfloat16, requires_grad=True)

        q, k, v = t(heads), t(kv_heads), t(kv_heads)
        gqa = kv_heads != heads

        def sdpa() -> Any:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

        with torch.no_grad():
            fw = self._time(sdpa, heat=True)
        g = torch.randn_like(sdpa())
        fb = self._time(lambda: sdpa().backward(g), heat=True)
        return fw, fb

    def cross_entropy(self, tokens: int, vocab: int, dtype: str) -> float:
        self._free()
        torch = self.torch
        import torch.nn.functional as F

        x = torch.randn(tokens, vocab, device=self.device, dtype=self.dtypes[dtype], requires_grad=True)
        labels = torch.randint(0, vocab, (tokens,), device=self.device)
        s = self._time(lambda: F.cross_entropy(x.float(), labels).backward())
        return s

    def embedding(self, tokens: int, vocab: int, hidden: int) -> float:
        self._free()
        torch = self.torch
        table = torch.nn.Embedding(vocab, hidden, device=self.device)
        ids = torch.randint(0, vocab, (tokens,), device=self.device)
        s = self._time(lambda: table(ids).sum().backward())
        return s

    def adamw(self, params: int, tensors: int, impl: str) -> float:
        self._free()
        torch = self.torch
        ps = [torch.nn.Parameter(torch.randn(params // tensors, device=self.device)) for _ in range(tensors)]
        for p in ps:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(ps, lr=1e-4, **({"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}))
        opt.step()  # the states, allocated
        s = self._time(opt.step, repeats=5, warmup=2)
        return s
