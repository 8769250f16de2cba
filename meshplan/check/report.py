"""A check's results as Markdown (a CI job summary), JUnit XML and JSON."""

from __future__ import annotations

import json
from xml.sax.saxutils import escape

from meshplan.check.compare import CaseResult, exit_code, show


def markdown(results: list[CaseResult]) -> str:
    """For $GITHUB_STEP_SUMMARY."""
    code = exit_code(results)
    head = {0: "✅ no regression", 1: "❌ regression", 2: "⚠️ error"}[code]
    lines = [f"## meshplan check: {head}", "", "| case | metric | old | new | status | note |", "|---|---|---|---|---|---|"]
    for r in results:
        if r.error:
            lines.append(f"| {r.case} | — | — | — | error | {r.error} |")
        for f in r.findings:
            lines.append(f"| {f.case} | {f.metric} | {_cell(f.old)} | {_cell(f.new)} | {f.status} | {f.note} |")
    return "\n".join(lines) + "\n"


def _cell(x: float | str | None) -> str:
    return show(x).replace("|", "\\|")


def junit(results: list[CaseResult]) -> str:
    """One testcase per case: a failure per regression, an error per case that could not be checked."""
    failures = sum(r.regressed for r in results)
    errors = sum(r.error is not None for r in results)
    out = ['<?xml version="1.0" encoding="UTF-8"?>',
           f'<testsuite name="meshplan check" tests="{len(results)}" failures="{failures}" errors="{errors}">']
    for r in results:
        out.append(f'  <testcase classname="meshplan.check" name="{escape(r.case)}">')
        if r.error:
            out.append(f'    <error message="{escape(r.error, {chr(34): "&quot;"})}"/>')
        for f in r.findings:
            if f.status == "regression":
                out.append(f'    <failure message="{escape(f.line(), {chr(34): "&quot;"})}"/>')
        body = "\n".join(f.line() for f in r.findings)
        out.append(f"    <system-out>{escape(body)}</system-out>")
        out.append("  </testcase>")
    out.append("</testsuite>")
    return "\n".join(out) + "\n"


def as_json(results: list[CaseResult]) -> str:
    return json.dumps({"exit_code": exit_code(results), "cases": [
        {"case": r.case, "error": r.error, "regressed": r.regressed,
         "findings": [{"metric": f.metric, "old": f.old, "new": f.new, "status": f.status, "note": f.note}
                      for f in r.findings]} for r in results]}, indent=1)
