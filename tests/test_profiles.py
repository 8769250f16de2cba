"""Hardware profiles: α-β closed forms, table interpolation, presets, validation errors, fits."""

from __future__ import annotations

import copy
import itertools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from cli import main
from core.collectives import Collective, LinkLevel, alpha_beta_time_s
from core.errors import ProfileError
from costmodel.device import collective_call_s, link_collective_time_s
from hwprofiles.files import list_presets, load_profile
from hwprofiles.fit import fit_alpha_beta, fit_efficiency, monotone_fit
from hwprofiles.profile import (
    CollectiveModel,
    EfficiencyCurve,
    TablePoint,
    profile_from_json,
    profile_to_json,
)

ALPHA, BETA = 2e-6, 100e9  # 2 µs per step, 100 GB/s bus bandwidth
AB = CollectiveModel(alpha_s=ALPHA, bus_bandwidth_bytes_per_s=BETA)


@pytest.mark.parametrize("n", [2, 4, 8, 64])
@pytest.mark.parametrize("size", [4096.0, 1 << 20, 1 << 30])
def test_alpha_beta_closed_forms(n: int, size: float) -> None:
    # Ring all-reduce: reduce-scatter then all-gather, each n−1 steps moving S/n per step.
    assert collective_call_s(AB, Collective.ALL_REDUCE, size, n) == pytest.approx(2 * (n - 1) * ALPHA + 2 * (n - 1) / n * size / BETA)
    # All-gather (S = output) and reduce-scatter (S = input): n−1 steps of S/n.
    for kind in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL):
        assert collective_call_s(AB, kind, size, n) == pytest.approx((n - 1) * ALPHA + (n - 1) / n * size / BETA)
    assert collective_call_s(AB, Collective.BROADCAST, size, n) == pytest.approx((n - 1) * ALPHA + size / BETA)
    assert collective_call_s(AB, Collective.SEND_RECV, size, n) == pytest.approx(ALPHA + size / BETA)


def test_single_rank_and_empty_message_cost_nothing() -> None:
    assert collective_call_s(AB, Collective.ALL_REDUCE, 1 << 20, 1) == 0.0
    assert collective_call_s(AB, Collective.ALL_REDUCE, 0, 8) == 0.0


def test_table_takes_precedence_interpolated_and_monotonic() -> None:
    # A measured dip at 4 MiB (noise) must not make a bigger message cheaper than a smaller one.
    table = (TablePoint(ranks=2, size_bytes=1 << 20, time_s=1e-3), TablePoint(ranks=2, size_bytes=4 << 20, time_s=0.5e-3),
             TablePoint(ranks=2, size_bytes=16 << 20, time_s=16e-3))
    m = CollectiveModel(alpha_s=ALPHA, bus_bandwidth_bytes_per_s=BETA, table=table)
    # The dip is pooled with the point before it (least squares under monotonicity): both 0.75 ms.
    assert collective_call_s(m, Collective.ALL_REDUCE, 1 << 20, 2) == pytest.approx(0.75e-3)
    assert collective_call_s(m, Collective.ALL_REDUCE, 4 << 20, 2) == pytest.approx(0.75e-3)
    sizes = np.geomspace(1 << 20, 16 << 20, 50)
    times = [collective_call_s(m, Collective.ALL_REDUCE, s, 2) for s in sizes]
    assert all(b >= a for a, b in itertools.pairwise(times))
    # Log-log interpolation between (4 MiB, 0.75 ms) and (16 MiB, 16 ms): at 8 MiB, √(0.75·16) ms.
    assert collective_call_s(m, Collective.ALL_REDUCE, 8 << 20, 2) == pytest.approx(math.sqrt(0.75 * 16) * 1e-3)
    # Outside the table's range, or at another rank count, the α-β model answers.
    assert collective_call_s(m, Collective.ALL_REDUCE, 64 << 20, 2) == pytest.approx(collective_call_s(AB, Collective.ALL_REDUCE, 64 << 20, 2))
    assert collective_call_s(m, Collective.ALL_REDUCE, 4 << 20, 4) == pytest.approx(collective_call_s(AB, Collective.ALL_REDUCE, 4 << 20, 4))


def test_monotone_fit_pools_adjacent_violators() -> None:
    assert monotone_fit([1.0, 2.0, 3.0]).tolist() == [1.0, 2.0, 3.0]
    assert monotone_fit([2.0, 1.0, 3.0]).tolist() == [1.5, 1.5, 3.0]
    # A high first mean pools with the later points it exceeds, not carried forward as a maximum.
    assert monotone_fit([2.1, 1.5, 1.3, 1.5, 1.2, 3.3]) == pytest.approx([1.52] * 5 + [3.3])
    assert monotone_fit([3.0, 2.0, 1.0]).tolist() == [2.0, 2.0, 2.0]


def test_efficiency_curve() -> None:
    e = EfficiencyCurve(max_fraction=0.8, half_flops=1e9)
    assert e.fraction(1e9) == pytest.approx(0.4)
    assert e.fraction(1e15) == pytest.approx(0.8, rel=1e-5)


@pytest.mark.parametrize("name", ["h100-sxm", "a100-sxm", "a100-sxm-roce", "a100-40gb-roce"])
def test_presets_load_with_sources(name: str) -> None:
    p = load_profile(name)
    assert p.origin["kind"] == "datasheet"
    assert p.devices_per_node == 8
    # Every value in the file says where it came from.
    assert all(src for src in p.sources.values())
    assert "device.peak_flops_per_s.bf16" in p.sources
    # Round trip through JSON keeps every number.
    assert profile_from_json(profile_to_json(p)) == p


def test_h100_numbers() -> None:
    p = load_profile("h100-sxm")
    assert p.device.peak_for("bf16") == pytest.approx(989.4e12)
    assert p.device.mem_bandwidth_bytes_per_s == pytest.approx(3.35e12)
    # 1 GiB ring all-reduce on 8 GPUs at 370 GB/s bus bandwidth: 2·7/8·2³⁰/370e9 s plus 14 steps of 1 µs.
    t = link_collective_time_s(p, Collective.ALL_REDUCE, 2**30, 8, LinkLevel.INTRA_NODE)
    assert t == pytest.approx(14e-6 + 2 * 7 / 8 * 2**30 / 370e9)
    # Inter-node all-reduce is priced with the InfiniBand figures (46 GB/s), ~8× slower.
    t_ib = link_collective_time_s(p, Collective.ALL_REDUCE, 2**30, 8, LinkLevel.INTER_NODE)
    assert t_ib / t == pytest.approx(370 / 46, rel=0.02)


def test_unlisted_collective_priced_from_its_link() -> None:
    p = load_profile("h100-sxm")
    m = p.collectives[(LinkLevel.INTRA_NODE, Collective.SEND_RECV)]
    assert m.bus_bandwidth_bytes_per_s == pytest.approx(450e9)
    assert m.alpha_s == pytest.approx(1e-6)


def _h100() -> dict[str, Any]:
    return copy.deepcopy(profile_to_json(load_profile("h100-sxm")))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["device"].pop("mem_bandwidth_bytes_per_s"), "field device: 'mem_bandwidth_bytes_per_s' is a required"),
        (lambda d: d["device"]["mem_capacity_bytes"].update(value=-1), "field device.mem_capacity_bytes.value"),
        (lambda d: d["network"]["latency_s"].update(unit="ms"), "field network.latency_s: unit must be 's'"),
        (lambda d: d["device"]["matmul_efficiency"]["max_fraction"].update(value=1.5), "max_fraction: a fraction of peak"),
        (lambda d: d["device"]["peak_flops_per_s"].pop("fp32"), "peak_flops_per_s.fp32"),
        (lambda d: d["device"]["kernel_launch_s"].pop("source"), "'source' is a required property"),
        (lambda d: d["collectives"]["intra_node"].update(all_sum={}), "field collectives.intra_node"),
        (lambda d: d["device"].update(optimizer_step={k: {"value": -1e-6 if k == "tensor_s" else 0.0, "unit": "s",
                                                          "source": "x"} for k in ("fixed_s", "tensor_s", "param_s")}),
         "field device.optimizer_step.tensor_s.value"),
    ],
)
def test_validation_names_the_field(mutate: Any, message: str) -> None:
    d = _h100()
    mutate(d)
    with pytest.raises(ProfileError, match=message.replace("(", r"\(").replace(".", r"\.")):
        profile_from_json(d)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["show", "h200"], "unknown profile 'h200'; known presets: a100-40gb-roce, a100-sxm, a100-sxm-roce, cpu, h100-sxm, h100-sxm-calibrated"),
        (["show", "{missing}.json"], "no such profile file"),
        (["show", "{bad}"], "malformed JSON at line 1"),
        (["show", "{negative}"], "field device.mem_capacity_bytes.value"),
        (["calibrate", "--nproc", "0"], "--nproc 0: needs at least 1 rank"),
        (["calibrate", "--nproc", "1"], "--nproc 1 measures no link"),
    ],
)
def test_cli_bad_input_one_line_exit_2(args: list[str], message: str, tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    d = _h100()
    d["device"]["mem_capacity_bytes"]["value"] = -80e9
    (tmp_path / "negative.json").write_text(json.dumps(d))
    paths = {"missing": str(tmp_path / "missing"), "bad": str(tmp_path / "bad.json"),
             "negative": str(tmp_path / "negative.json")}
    r = CliRunner().invoke(main, ["profile", *[a.format(**paths) for a in args]])
    assert r.exit_code == 2
    assert message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_cli_list_and_show_json() -> None:
    r = CliRunner().invoke(main, ["profile", "list"])
    assert r.exit_code == 0 and all(name in r.stdout for name in list_presets())
    r = CliRunner().invoke(main, ["profile", "show", "a100-sxm", "--json"])
    assert r.exit_code == 0
    assert json.loads(r.stdout)["device"]["peak_flops_per_s"]["bf16"]["value"] == pytest.approx(312e12)


def test_fit_alpha_beta_recovers_parameters() -> None:
    sizes = np.geomspace(4096, 256 << 20, 9)
    for kind in Collective:
        times = [alpha_beta_time_s(kind, s, 4, AB.alpha_s, AB.bus_bandwidth_bytes_per_s) for s in sizes]
        fit = fit_alpha_beta(kind, 4, sizes, times)
        assert fit.alpha_s == pytest.approx(ALPHA, rel=1e-6)
        assert fit.bus_bandwidth_bytes_per_s == pytest.approx(BETA, rel=1e-6)
        assert fit.median_rel_error < 1e-9


def test_fit_efficiency_recovers_curve() -> None:
    flops = np.geomspace(1e5, 1e10, 8)
    achieved = 50e9 * flops / (flops + 3e6)
    fit = fit_efficiency(flops, achieved)
    assert fit.peak_achieved_flops_per_s == pytest.approx(50e9, rel=1e-6)
    assert fit.half_flops == pytest.approx(3e6, rel=1e-6)
