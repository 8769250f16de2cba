"""A GPU profile fitted from an H100's measurements (`calibrate --from bench/gpu/h100/micro.json`),
checked against those measurements: every GEMM, element-wise op and AdamW step the file holds, the
alignment cliff of an LM head, and the refusals of files that are not measurement files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from cli import main
from costmodel.device import matmul_time_s
from hwprofiles.files import load_profile
from hwprofiles.measured import MeasurementError, align_bytes, fit_measurements, load_measurements
from hwprofiles.profile import HardwareProfile, profile_from_json

MICRO = Path(__file__).parents[1] / "bench" / "gpu" / "h100" / "micro.json"


@pytest.fixture(scope="module")
def measured() -> dict:
    return load_measurements(MICRO)


@pytest.fixture(scope="module")
def h100(measured: dict) -> HardwareProfile:
    fitted, _ = fit_measurements(measured, origin=str(MICRO))
    return profile_from_json(fitted)


def _gemm_s(p: HardwareProfile, m: int, n: int, k: int, dtype: str = "bf16") -> float:
    """One GEMM called alone, as the file timed it: its launch, then its kernel."""
    aligned = min(align_bytes(k, 2), align_bytes(n, 2)) if dtype == "bf16" else 16  # fp32: no tensor cores
    return p.device.kernel_launch_s + matmul_time_s(p.device, 2.0 * m * n * k, dtype, min(m, n, k), aligned)


def test_calibrate_from_writes_a_gpu_profile(tmp_path: Path) -> None:
    out = tmp_path / "h100.json"
    r = CliRunner().invoke(main, ["profile", "calibrate", "--from", str(MICRO), "--out", str(out)])
    assert r.exit_code == 0, r.output
    p = load_profile(out)
    dev = p.device
    assert p.origin["base"] == "h100-sxm" and dev.async_launch
    # 755 TFLOP/s of the datasheet's 989: the fitted asymptote of the aligned bf16 GEMMs.
    assert 0.70 < dev.matmul_efficiency.max_fraction < 0.82
    assert dev.kernel_launch_s == pytest.approx(json.loads(MICRO.read_text())["launch_s"])
    assert dev.optimizer_step is not None and dev.elementwise_by_op is not None
    assert {"Add", "Mul", "Softmax", "LayerNormalization", "Tanh", "Cast"} <= set(dev.elementwise_by_op)
    assert "GEMM curve" in r.output and "AdamW (fused)" in r.output


def test_fitted_curve_prices_the_measured_gemms(h100: HardwareProfile, measured: dict) -> None:
    rows = [r for r in measured["matmul"] if r["dtype"] == "bf16"]
    err = np.array([_gemm_s(h100, r["m"], r["n"], r["k"]) / r["s"] - 1 for r in rows])
    assert np.median(np.abs(err)) < 0.08, np.median(np.abs(err))
    assert np.mean(np.abs(err) < 0.25) > 0.9


def test_fp32_gemms_have_their_own_curve(h100: HardwareProfile, measured: dict) -> None:
    """fp32 GEMMs (CUDA cores, TF32 off) on a curve fitted to them: 58 TFLOP/s, 87% of the datasheet's
    66.9, where the bf16 curve scaled to that peak said 76% (12.6% median error, 343% at 256³)."""
    curve = h100.device.matmul_curve("fp32")
    assert curve is not h100.device.matmul_efficiency and 0.80 < curve.max_fraction < 0.92
    rows = [r for r in measured["matmul"] if r["dtype"] == "fp32"]
    err = np.array([_gemm_s(h100, r["m"], r["n"], r["k"], "fp32") / r["s"] - 1 for r in rows])
    assert np.median(np.abs(err)) < 0.06, np.median(np.abs(err))
    assert np.mean(np.abs(err) < 0.25) > 0.9


@pytest.mark.parametrize(("tokens", "hidden", "odd", "even"), [(4096, 768, 50257, 50304), (16384, 768, 50257, 50304),
                                                              (4096, 4096, 32001, 32000), (16384, 4096, 32001, 32000)])
def test_lm_head_alignment_cliff(h100: HardwareProfile, measured: dict, tokens: int, hidden: int, odd: int,
                                 even: int) -> None:
    """A vocabulary that is not a multiple of 8 (2-byte aligned rows in bf16) runs the LM head's GEMM
    4.7–6.2× slower on the H100; the fitted profile prices the ratio within 25%."""
    t = {(r["m"], r["n"], r["k"]): r["s"] for r in measured["matmul"] if r["dtype"] == "bf16" and "layout" not in r}
    want = t[tokens, odd, hidden] / t[tokens, even, hidden]
    got = _gemm_s(h100, tokens, odd, hidden) / _gemm_s(h100, tokens, even, hidden)
    assert want > 4
    assert got == pytest.approx(want, rel=0.25)


def test_fitted_elementwise_and_optimizer_rates(h100: HardwareProfile, measured: dict) -> None:
    """The largest bf16 element-wise ops and every fused AdamW step, priced from the profile, within
    15% of the file's times."""
    names = {"add": "Add", "mul": "Mul", "tanh": "Tanh", "softmax": "Softmax", "layer_norm": "LayerNormalization"}
    dev = h100.device
    for r in measured["elementwise"]:
        if r["dtype"] == "bf16" and r["numel"] == 1 << 27 and r["op"] in names:
            nbytes = r["fwd_GBps_min_traffic"] * 1e9 * r["fwd_s"]
            assert dev.kernel_launch_s + nbytes / dev.elementwise_rate(names[r["op"]]) == \
                pytest.approx(r["fwd_s"], rel=0.15), r["op"]
    opt = dev.optimizer_step
    assert opt is not None
    for r in measured["adamw"]:
        if r["impl"] == "fused":
            assert opt.fixed_s + r["tensors"] * opt.tensor_s + r["params"] * opt.param_s == \
                pytest.approx(r["step_s"], rel=0.15)


def test_a_fit_far_off_is_refused(measured: dict) -> None:
    """GEMM times that no curve of the model can follow (each shape's time shuffled among the
    others) are refused with the reason, and the base's curve stays."""
    rng = np.random.default_rng(0)
    shuffled = json.loads(json.dumps(measured))
    times = [r["s"] for r in shuffled["matmul"]]
    for r, t in zip(shuffled["matmul"], rng.permutation(times), strict=True):
        r["s"] = float(t)
    fitted, lines = fit_measurements(shuffled, origin="shuffled")
    gemm = next(f for f in lines if f.what.startswith("GEMM curve"))
    assert not gemm.accepted and "base's curve kept" in gemm.note
    assert fitted["device"]["matmul_efficiency"]["max_fraction"]["value"] == 0.8  # h100-sxm's


@pytest.mark.parametrize(("content", "says"), [
    ('{"matmul": []}', "no `matmul` list"),
    ("[1, 2]", "a JSON object is expected"),
    ("not json", "is not JSON"),
    ('{"matmul": [{"m": 1, "n": 1, "k": 1, "dtype": "bf16", "s": -1}], "elementwise": '
     '[{"op": "add", "dtype": "bf16", "numel": 1, "fwd_s": 1, "fwd_bwd_s": 1}], "launch_s": 1e-5}', "not positive"),
])
def test_not_a_measurement_file(tmp_path: Path, content: str, says: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    with pytest.raises(MeasurementError, match=says):
        load_measurements(bad)
    r = CliRunner().invoke(main, ["profile", "calibrate", "--from", str(bad), "--out", str(tmp_path / "x.json")])
    assert r.exit_code == 2 and says in r.output and len(r.output.strip().splitlines()) == 1, r.output
    assert not (tmp_path / "x.json").exists()


def test_a_device_without_a_preset_needs_a_base(measured: dict) -> None:
    with pytest.raises(MeasurementError, match="pass `base`"):
        fit_measurements({**measured, "device": "Some Accelerator"}, origin="f.json")


def _step_s(tmp: Path, profile: Path | str, config: str, vocab: int, dims: dict[str, int]) -> float:
    """One eager amp step on one device of bench/gpu/configs/<config>.json at `vocab`."""
    from bench.gpu_steps import exported
    from planner.export import export_hf_config
    from planner.search.plan import make_plan
    from planner.search.request import PlanRequest

    raw = json.loads((MICRO.parents[1] / "configs" / f"{config}.json").read_text())
    model = exported(config)  # shared with bench --only gpu and its test
    if raw["vocab_size"] != vocab:
        (tmp / f"{config}-{vocab}.json").write_text(json.dumps({**raw, "vocab_size": vocab}))
        model = tmp / f"{config}-{vocab}.onnx"
        export_hf_config(tmp / f"{config}-{vocab}.json", model, dims={"batch": None, "seq": None})
    s, _ = make_plan(PlanRequest(model=str(model), dims=dims, profile=str(profile), devices=1, dtype="amp"))
    return s.step_time_s


def _native_vocab_ratio() -> float:
    """Llama-2-7B widths, 2 layers, 4 × 2048 tokens, eager amp on the H100 (2026-11-26 13:50 UTC,
    bench/gpu/h100/session-2026-11-26-1347/native-vocab.json): the step at vocab 32001 over 32000."""
    rows = json.loads((MICRO.parents[1] / "h100" / "session-2026-11-26-1347" / "native-vocab.json").read_text())
    step = {r["model"]: r["step_s"] for r in rows if r["precision"] == "amp"}
    return step["llama2-7b-2l-v32001"] / step["llama2-7b-2l-v32000"]


@pytest.mark.slow
@pytest.mark.parametrize("which", ["micro.json", "h100-sxm", "h100-sxm-calibrated"])
@pytest.mark.parametrize("case", ["gpt2-50257", "llama2-32001"])
def test_vocab_alignment_in_a_whole_step(tmp_path: Path, measured: dict, which: str, case: str) -> None:
    """Two whole steps measured on the H100 in eager amp, priced on the profile fitted to the
    microbenchmarks alone, the datasheet preset (its alignment from those measurements) and the preset
    calibrated on an H100:
    - GPT-2-124M, 16 × 1024 tokens: 123.3 ms with vocab 50257 (bench/gpu/h100/steps.json) against 98 ms
      with 50304 (shared/gpu/README.md), 1.26×; priced 1.278, 1.233, 1.255 — within 5 points;
    - Llama-2-7B widths, 2 layers, 4 × 2048 tokens: 117.0 ms with vocab 32001 against 74.4 ms with
      32000, 1.572× (fp32: 1.003×, no tensor cores); priced 1.513, 1.527, 1.535 — within 6 points."""
    profile: Path | str = which
    if which == "micro.json":
        fitted, _ = fit_measurements(measured, origin=str(MICRO))
        profile = tmp_path / "h100.json"
        profile.write_text(json.dumps(fitted))
    if case == "gpt2-50257":
        dims = {"batch": 16, "seq": 1024}
        ratio = _step_s(tmp_path, profile, "gpt2-124m", 50257, dims) / _step_s(tmp_path, profile, "gpt2-124m", 50304, dims)
        assert abs(ratio - 123.3 / 98.0) < 0.05, ratio
    else:
        dims = {"batch": 4, "seq": 2048}
        config = "llama2-7b-2l-v32000"
        ratio = _step_s(tmp_path, profile, config, 32001, dims) / _step_s(tmp_path, profile, config, 32000, dims)
        assert abs(ratio - _native_vocab_ratio()) < 0.06, ratio


class FakeH100:
    """A `gpu_sweeps.KernelTimer` answering from the measurement file: a kernel the file timed at its
    time, a GEMM it did not from its squares in the same dtype (log-log in FLOPs), an element-wise op
    at another size from its sizes (log-log in elements; past the largest, in proportion)."""

    def __init__(self, data: dict) -> None:
        self.data = data
        self.gemms = {(r["m"], r["n"], r["k"], r["dtype"]): r["s"] for r in data["matmul"] if "layout" not in r}

    def _at(self, xs: list[float], ys: list[float], x: float) -> float:
        """Log-log between the file's points; past the largest, time in proportion (saturated)."""
        if x > xs[-1]:
            return ys[-1] * x / xs[-1]
        return float(np.exp(np.interp(np.log(x), np.log(xs), np.log(ys))))

    def info(self) -> dict:
        return {"device": self.data["device"], "torch": self.data["torch"], "sm_count": self.data["sm_count"],
                "memory_bytes": 80 << 30}

    def launch(self) -> float:
        return float(self.data["launch_s"])

    def gemm(self, m: int, n: int, k: int, dtype: str) -> float:
        if (m, n, k, dtype) in self.gemms:
            return float(self.gemms[m, n, k, dtype])
        sq = sorted((2.0 * a**3, t) for (a, b, c, d), t in self.gemms.items() if a == b == c and d == dtype)
        return self._at([f for f, _ in sq], [t for _, t in sq], 2.0 * m * n * k)

    def elementwise(self, op: str, dtype: str, numel: int) -> tuple[float, float]:
        rows = sorted((r for r in self.data["elementwise"] if r["op"] == op and r["dtype"] == dtype),
                      key=lambda r: r["numel"])
        n = [r["numel"] for r in rows]
        return self._at(n, [r["fwd_s"] for r in rows], numel), self._at(n, [r["fwd_bwd_s"] for r in rows], numel)

    def attention(self, batch: int, heads: int, kv_heads: int, seq: int, head_dim: int,
                  causal: bool) -> tuple[float, float]:
        r = next(r for r in self.data["attention_sdpa"] if (r["batch"], r["heads"], r["kv_heads"], r["seq"],
                 r["head_dim"], r["causal"]) == (batch, heads, kv_heads, seq, head_dim, causal))
        return r["fwd_s"], r["fwd_bwd_s"]

    def cross_entropy(self, tokens: int, vocab: int, dtype: str) -> float:
        return next(r["fwd_bwd_s"] for r in self.data["cross_entropy"]
                    if (r["tokens"], r["vocab"], r["logits_dtype"]) == (tokens, vocab, dtype))

    def embedding(self, tokens: int, vocab: int, hidden: int) -> float:
        return next(r["fwd_bwd_s"] for r in self.data["embedding"] if (r["tokens"], r["vocab"], r["hidden"]) ==
                    (tokens, vocab, hidden))

    def adamw(self, params: int, tensors: int, impl: str) -> float:
        return next(r["step_s"] for r in self.data["adamw"] if (r["params"], r["tensors"], r["impl"]) ==
                    (params, tensors, impl))


@pytest.mark.parametrize("quick", [False, True])
def test_gpu_sweep_reaches_saturation(measured: dict, quick: bool) -> None:
    """calibrate's sweep on a GPU (`gpu_sweeps.measure`), against a fake H100 answering from the file:
    its GEMM squares grow past the launch-bound sizes to >= 8192³ and >= 1 ms a call, its element-wise
    ops reach 2^26 elements in bf16, and the profile fitted from what it measured has its GEMM peak
    within 5% of the fastest square the file measured, every fit written."""
    from hwprofiles.gpu_sweeps import SATURATED, measure

    fake = FakeH100(measured)
    data = measure(fake, quick=quick)
    squares = {r["m"]: r["s"] for r in data["matmul"] if r["dtype"] == "bf16" and r["m"] == r["n"] == r["k"]}
    assert min(squares) <= 512 and squares[max(squares)] >= 1e-3 and squares[max(squares) // 2] < 1e-3  # stops there
    adds = {r["numel"]: r["fwd_s"] for r in data["elementwise"] if r["op"] == "add" and r["dtype"] == "bf16"}
    last = max(adds)  # doubled from 2^26 until flat: twice the time at twice the size
    assert last > 1 << 26 and adds[last] >= SATURATED * adds[last // 2] and adds[last // 2] < SATURATED * adds[last // 4]
    assert any(min(align_bytes(r["k"], 2), align_bytes(r["n"], 2)) < 16 for r in data["matmul"])
    fitted, lines = fit_measurements(load_measurements_dict(data))
    assert all(line.accepted for line in lines), [line for line in lines if not line.accepted]
    peak = fitted["device"]["matmul_efficiency"]["max_fraction"]["value"] * fitted["device"]["peak_flops_per_s"]["bf16"]["value"]
    best = max(2.0 * r["m"] ** 3 / r["s"] for r in measured["matmul"]
               if r["dtype"] == "bf16" and r["m"] == r["n"] == r["k"])
    assert peak == pytest.approx(best, rel=0.05), (peak / 1e12, best / 1e12)
    assert {line.what.split(" (")[0] for line in lines} >= {"kernel launch", "GEMM curve", "GEMM alignment",
                                                             "FlashAttention forward", "AdamW"}


def load_measurements_dict(data: dict) -> dict:
    """`data` through the file checks `calibrate --from` runs (a written file's round trip)."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(data, f)
    return load_measurements(f.name)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="asserts the refusal on a machine without a GPU")
def test_calibrate_nccl_without_a_gpu_is_one_line(tmp_path: Path) -> None:
    r = CliRunner().invoke(main, ["profile", "calibrate", "--backend", "nccl", "--nproc", "1", "--compute-only",
                                  "--base", "h100-sxm", "--out", str(tmp_path / "p.json")])
    assert r.exit_code == 2 and "needs CUDA" in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_calibrate_on_a_gpu_writes_the_profile_and_its_measurements(tmp_path: Path, measured: dict,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`calibrate --backend nccl --nproc 1 --compute-only` end to end, the device a fake H100 answering
    from the file: the profile written, its measurements beside it (the provenance `--from` re-fits)."""
    import torch

    import hwprofiles.gpu_sweeps as sweeps

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(sweeps, "CudaTimer", lambda device: FakeH100(measured))
    out = tmp_path / "h100.json"
    r = CliRunner().invoke(main, ["profile", "calibrate", "--backend", "nccl", "--nproc", "1", "--compute-only",
                                  "--base", "h100-sxm", "--quick", "--out", str(out)])
    assert r.exit_code == 0, r.output
    p = load_profile(out)
    assert p.device.async_launch and p.device.optimizer_step is not None and "GEMM curve" in r.output
    again, _ = fit_measurements(load_measurements(out.with_suffix(".micro.json")))
    assert again["device"]["matmul_efficiency"]["max_fraction"]["value"] == pytest.approx(p.device.matmul_efficiency.max_fraction)


def test_calibrate_on_a_gpu_without_a_preset_stops_before_measuring(tmp_path: Path, measured: dict,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU no preset names, and no --base (links measured on 2 GPUs): one line, exit 2, before any
    kernel or link is timed."""
    import torch

    import hwprofiles.gpu_sweeps as sweeps

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _i=None: "NVIDIA L4")
    timed: list[str] = []
    monkeypatch.setattr(sweeps, "CudaTimer", lambda device: timed.append("timer") or FakeH100(measured))
    r = CliRunner().invoke(main, ["profile", "calibrate", "--backend", "nccl", "--nproc", "2", "--quick",
                                  "--out", str(tmp_path / "p.json")])
    assert r.exit_code == 2 and "NVIDIA L4 has no preset" in r.output and not timed, r.output
