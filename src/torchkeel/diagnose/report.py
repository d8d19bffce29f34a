"""The short human report of ``keel diagnose`` (without ``--json``)."""

from __future__ import annotations

from typing import Any


def human_report(diagnosis: Any) -> str:
    o = diagnosis.outcome
    ended = o.stopped or (
        f"raised {o.error['type']}: {o.error['message'][:120]}" if o.error else f"exited with status {o.exit_status}"
    )
    lines = [
        f"keel diagnose: {o.path}: {diagnosis.facts.steps} optimizer steps, "
        f"{diagnosis.facts.backward_calls} backward calls, {o.wall_s:.1f} s; {ended}"
    ]
    if diagnosis.repro.get("compared"):
        lines.append(
            f"reproducibility: {diagnosis.repro['runs']} runs compared over {diagnosis.repro['compared']} losses"
        )
    if not diagnosis.findings:
        lines.append("no findings")
    for i, f in enumerate(diagnosis.findings, 1):
        lines.append(f"{i}. [{f.severity}] {f.id}: {f.message}")
        lines.append(f"   fix: {f.fix}")
    return "\n".join(lines)
