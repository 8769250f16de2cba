"""`meshplan check`: each kind of regression caught with exit 1 and named (model, profile, planning
change, memory), an improvement passing as one, broken inputs refused with exit 2 in one line, the
reports (Markdown, JUnit, JSON) and plans identical run after run."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from xml.etree import ElementTree

import pytest
from click.testing import CliRunner

from cli import main

GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256, "n_positions": 64,
        "tie_word_embeddings": True}


def _write(tmp: Path, cases: str, **files: dict) -> Path:
    for name, content in files.items():
        (tmp / f"{name}.json").write_text(json.dumps(content))
    cfg = tmp / "meshplan-check.toml"
    cfg.write_text(cases)
    return cfg


def _check(cfg: Path, *args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(main, ["check", "--config", str(cfg), *args])
    return r.exit_code, r.stdout, r.stderr


def _case(model_line: str, extra: str = "", devices: int = 2, profile: str = "cpu") -> str:
    return f'[[case]]\nname = "c"\n{model_line}\ndevices = {devices}\nprofile = "{profile}"\n' \
           f'dims = {{ batch = 16, seq = 32 }}\n{extra}\n'


def _regressed(cfg: Path, metric: str) -> None:
    code, out, _ = _check(cfg, "--json")
    report = json.loads(out)
    assert code == 1 and report["exit_code"] == 1, out
    hits = [f for f in report["cases"][0]["findings"] if f["status"] == "regression"]
    assert any(f["metric"] == metric and f["new"] > f["old"] for f in hits), hits


def test_model_changes_caught(tmp_path: Path) -> None:
    # The model as a transformers config exported on the fly (the recipe): one more layer, then a wider
    # FFN, each raising the predicted step time past +2%.
    cfg = _write(tmp_path, _case('hf_config = "gpt2.json"'), gpt2=GPT2)
    code, out, err = _check(cfg, "--update")
    assert code == 0 and (tmp_path / "meshplan-baseline" / "c" / "strategy.json.gz").is_file(), err
    reference = tmp_path / "meshplan-baseline" / "c" / "reference.json"
    assert json.loads(reference.read_text())["planning_reference_s"] > 0  # the machine's speed when accepted
    code, out, _ = _check(cfg)
    assert code == 0 and "no regression" in out
    _write(tmp_path, _case('hf_config = "gpt2.json"'), gpt2={**GPT2, "n_layer": 3})
    _regressed(cfg, "predicted step time (s)")
    _write(tmp_path, _case('hf_config = "gpt2.json"'), gpt2={**GPT2, "n_inner": 1024})
    _regressed(cfg, "predicted step time (s)")
    reference.write_text('{"planning_reference_s": "fast"}')
    code, _, err = _check(cfg)
    assert code == 2 and "reference.json: not a planning reference" in err and len(err.strip().splitlines()) == 1, err


def test_solver_time_judged_at_the_baselines_machine_speed() -> None:
    # Llama-3-8B's 8×8 solve took 1.7 s when its baseline was written and 4.6 s a day later on the same
    # code: ×2.7, a regression on an unchanged machine, none on one whose planning workload now runs
    # 2.5× slower (4.6 / 2.5 = 1.84 s, within ×2 of 1.7).
    from meshplan.check import Tolerance, solver_time_finding

    t = Tolerance()
    found = solver_time_finding("c", 1.7, 4.6, 1.0, t)
    assert found is not None and found.status == "regression" and "×2.7 >" in found.note
    assert solver_time_finding("c", 1.7, 4.6, 2.5, t) is None
    # Slower than the machine accounts for: still caught (4.6 / 1.2 = 3.83 s > 2 × 1.7, and 2.1 s more).
    found = solver_time_finding("c", 1.7, 4.6, 1.2, t)
    assert found is not None and "×2.3 at the baseline's machine speed (this machine ×1.20 slower)" in found.note
    # Within the slack second: 0.2 → 0.6 s is ×3 but no finding.
    assert solver_time_finding("c", 0.2, 0.6, 1.0, t) is None


def test_profile_planning_and_memory_changes_caught(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    # The profile: H100 nodes with the inter-node bandwidth halved; Llama-3-8B on 16 devices over 2 nodes,
    # 16 × 2048 tokens (its gradients cross the nodes: +13%).
    preset = json.loads((Path(__file__).parent.parent / "hwprofiles" / "presets" / "h100-sxm.json").read_text())
    big = _case(f'model = "{zoo("llama3-8b")}"', devices=16, profile="fabric.json").replace("seq = 32", "seq = 2048")
    cfg = _write(tmp_path, big, fabric=preset)
    assert _check(cfg, "--update")[0] == 0
    slow = json.loads(json.dumps(preset))
    slow["network"]["bandwidth_bytes_per_s"]["value"] /= 2
    for fit in slow["collectives"]["inter_node"].values():
        fit["bus_bandwidth_bytes_per_s"]["value"] /= 2
    _write(tmp_path, big, fabric=slow)
    _regressed(cfg, "predicted step time (s)")
    model = f'model = "{zoo("gpt2-tiny")}"'
    # A planning change: a pin that splits the LM head's weight over its vocabulary rows (13.5 → 15.8 ms
    # on this machine's profile).
    cfg = _write(tmp_path, _case(model))
    assert _check(cfg, "--update")[0] == 0
    _write(tmp_path, _case(model, 'pins = { "model.lm_head.weight" = "S(0)" }\nmode = "semi"'))
    _regressed(cfg, "predicted step time (s)")
    # Memory beyond its tolerance (the step time's tolerance widened so that memory alone is judged).
    _write(tmp_path, _case(model, "[case.tolerance]\nstep_time = 10.0").replace("batch = 16", "batch = 24"))
    code, out, _ = _check(cfg, "--json")
    findings = json.loads(out)["cases"][0]["findings"]
    assert code == 1 and [f["metric"] for f in findings if f["status"] == "regression"] == ["memory per device (bytes)"]


def test_improvement_passes_and_reports(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    model = f'model = "{zoo("gpt2-tiny")}"'
    cfg = _write(tmp_path, _case(model).replace("batch = 16", "batch = 24"))
    assert _check(cfg, "--update")[0] == 0
    _write(tmp_path, _case(model))
    md, xml = tmp_path / "summary.md", tmp_path / "report.xml"
    code, out, _ = _check(cfg, "--summary", str(md), "--junit", str(xml))
    assert code == 0 and "improvement" in out
    assert "| c | predicted step time (s) |" in md.read_text() and "improvement" in md.read_text()
    suite = ElementTree.parse(xml).getroot()
    assert suite.get("tests") == "1" and suite.get("failures") == "0" and suite.find("testcase") is not None


@pytest.mark.parametrize(("setup", "message"), [
    (lambda t, z: _write(t, "[[case]]\nname = 'c'\ndevices = ["), "not valid TOML"),
    (lambda t, z: _write(t, _case(f'model = "{z("gpt2-tiny")}"', 'colour = "red"')), "unknown key 'colour'"),
    (lambda t, z: _write(t, _case('model = "nowhere.onnx"')), "model nowhere.onnx not found beside the config"),
    (lambda t, z: _write(t, _case(f'model = "{z("gpt2-tiny")}"')), "no baseline for case 'c'"),
])
def test_broken_inputs_exit_2_in_one_line(setup: Callable[[Path, Callable[[str], Path]], Path], message: str,
                                          zoo: Callable[[str], Path], tmp_path: Path) -> None:
    code, _, err = _check(setup(tmp_path, zoo))
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_model_that_no_longer_imports_exits_2(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    model = tmp_path / "m.onnx"
    model.write_bytes(zoo("gpt2-tiny").read_bytes())
    cfg = _write(tmp_path, _case('model = "m.onnx"'))
    assert _check(cfg, "--update")[0] == 0
    model.write_bytes(b"not an onnx file")
    code, _, err = _check(cfg)
    assert code == 2 and "c: " in err and len(err.strip().splitlines()) == 1, err


def test_plans_are_identical_run_after_run(zoo: Callable[[str], Path], tmp_path: Path) -> None:
    # The same inputs give the same strategy file, byte for byte but the solver's wall time, in fresh
    # processes (other hash seeds: nothing may depend on set order) and with 1 or 2 solver threads —
    # for CBC, and for CP-SAT (seeded, its deterministic parallel search). CP-SAT on 2 devices: on 4,
    # the 2x2 mesh's overlapped ILP takes it about 50 s (CBC 1.6 s; milp.py).
    texts: dict[str, set[str]] = {"cbc": set(), "cpsat": set()}
    for i, (seed, workers, solver) in enumerate([(0, 1, "cbc"), (1, 2, "cbc"), (3, 1, "cpsat"), (4, 2, "cpsat")]):
        out = tmp_path / f"s{i}.json"
        devices = "4" if solver == "cbc" else "2"
        subprocess.run([sys.executable, "-m", "cli", "plan", str(zoo("llama-tiny")), "--devices", devices, "--profile",
                        "h100-sxm", "--dim", "seq=32", "--global-batch-size", "16", "--workers", str(workers),
                        "--solver", solver, "-o", str(out)], check=True, capture_output=True,
                       env={**__import__("os").environ, "PYTHONHASHSEED": str(seed)})
        plan = json.loads(out.read_text())
        plan["solver"].pop("time_s")
        texts[solver].add(json.dumps(plan, sort_keys=True))
    assert [len(t) for t in texts.values()] == [1, 1]


def test_example_workflow_is_a_github_workflow() -> None:
    # examples/ci: the workflow parses as YAML with GitHub's keys (on, jobs.<id>.runs-on, steps each a
    # `uses: action@version` or a `run`), installs meshplan and runs the gate on the example's config,
    # which exists with a baseline per case.
    import tomllib

    import yaml

    root = Path(__file__).parent.parent / "examples" / "ci"
    wf = yaml.safe_load((root / "github-workflow.yml").read_text())
    on = wf.get("on", wf.get(True))  # YAML 1.1 reads the key `on` as true
    assert "pull_request" in on
    (job,) = wf["jobs"].values()
    assert job["runs-on"] == "ubuntu-latest"
    assert all(("uses" in st) != ("run" in st) and ("@" in st["uses"] if "uses" in st else True) for st in job["steps"])
    runs = " ".join(st.get("run", "") for st in job["steps"])
    assert "pip install" in runs and "meshplan check --config examples/ci/meshplan-check.toml" in runs
    assert '--summary "$GITHUB_STEP_SUMMARY"' in runs and "--junit" in runs
    cases = tomllib.loads((root / "meshplan-check.toml").read_text())["case"]
    assert len(cases) == 2 and all((root / "meshplan-baseline" / c["name"] / "strategy.json.gz").is_file() for c in cases)


def _measured(step_ms: list[float], ref_ms: float, predicted_ms: float) -> dict:
    from meshplan.check.measure import _summary

    return _summary([(x / 1e3, ref_ms / 1e3) for x in step_ms], predicted_ms / 1e3)


def test_measured_regressions_beyond_tolerance_and_noise() -> None:
    # The rules of --run on numbers: the new plan against the baseline's run side by side (paired
    # ratios), and — judged only where stored_step_time is set — the baseline plan against its stored
    # measurement as multiples of the reference workload; each flagged only past the tolerance (+10%)
    # and 3 × the median's error.
    from dataclasses import replace

    from meshplan.check import Case, Tolerance, compare_measured
    from planner.search.request import PlanRequest

    case = Case(name="c", model="m.onnx", request=PlanRequest(model="m.onnx"), tolerance=Tolerance(stored_step_time=0.1))
    stored = _measured([10.0, 10.2, 9.8], 5.0, 10.0)

    def findings(new_ms: list[float], base_ms: list[float], ref_ms: float, c: Case = case) -> dict[str, str]:
        new = _measured(new_ms, ref_ms, 10.0)
        new["baseline_now"] = _measured(base_ms, ref_ms, 10.0)
        pairs = [b / a for a, b in zip(base_ms, new_ms, strict=True)]
        med = sorted(pairs)[1]
        new["paired"] = {"ratios": pairs, "median": med, "mad": sorted(abs(x - med) for x in pairs)[1]}
        return {f.metric.split(" (")[0].split(",")[0]: f.status for f in compare_measured(c, stored, new)}

    same = findings([10.1, 9.9, 10.0], [10.0, 10.1, 9.9], 5.0)
    assert set(same.values()) == {"ok"}
    # The new plan 30% slower than the baseline's, run beside it: caught.
    assert findings([13.0, 13.2, 12.9], [10.0, 10.1, 9.9], 5.0)["measured step"] == "regression"
    # 30% slower in the median but the pairs scatter by ±25%: within the noise.
    assert findings([13.0, 10.0, 15.5], [10.0, 10.1, 9.9], 5.0)["measured step"] == "ok"
    # The whole machine 40% slower (the reference too): no regression of the baseline plan.
    assert findings([14.1, 13.9, 14.0], [14.0, 14.1, 13.9], 7.0)["measured step of the baseline plan"] == "ok"
    # The baseline plan 30% slower on the same machine (the code changed): caught where judged, else
    # reported as changed.
    assert findings([13.1, 12.9, 13.0], [13.0, 13.1, 12.9], 5.0)["measured step of the baseline plan"] == "regression"
    unjudged = replace(case, tolerance=Tolerance())
    assert findings([13.1, 12.9, 13.0], [13.0, 13.1, 12.9], 5.0, unjudged)["measured step of the baseline plan"] == \
        "changed"
    # The new plan predicted as before but measured 30% slower than the baseline's side by side: its
    # drift from its measurement grows past 10 points.
    assert findings([13.0, 13.2, 12.9], [10.0, 10.1, 9.9], 5.0)["prediction drift"] == "regression"
