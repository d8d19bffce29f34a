"""``keel diagnose``: run an unmodified PyTorch script under instrumentation and name the root
cause of what goes wrong (see docs/diagnose.md for every finding id)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from torchkeel.diagnose.compiled import CompileWatch
from torchkeel.diagnose.detectors import judge
from torchkeel.diagnose.findings import FINDING_IDS, Finding, order_findings
from torchkeel.diagnose.probe import Facts, Probe
from torchkeel.diagnose.repro import check_reproducible
from torchkeel.diagnose.runner import ScriptOutcome, run_script

# A run shorter than this is checked for reproducibility by default (a second run costs as much).
REPRO_MAX_S = 30.0


@dataclasses.dataclass
class Diagnosis:
    """The report: findings (root cause first), how the script ended, and what was observed."""

    findings: list[Finding]
    outcome: ScriptOutcome
    facts: Facts
    repro: dict[str, Any]
    wall_s: float

    @property
    def has_errors(self) -> bool:
        return any(f.severity == "error" for f in self.findings)

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` document (its schema: docs/diagnose.schema.json)."""
        o = self.outcome
        return {
            "findings": [f.to_dict() for f in self.findings],
            "script": {
                "path": o.path,
                "argv": o.argv,
                "exit_status": o.exit_status,
                "error": o.error,
                "stopped": o.stopped,
                "wall_s": round(o.wall_s, 3),
            },
            "steps": self.facts.steps,
            "backward_calls": self.facts.backward_calls,
            "repro": self.repro,
            "wall_s": round(self.wall_s, 3),
        }


def diagnose_script(
    script: str,
    args: list[str] | None = None,
    *,
    steps: int | None = None,
    timeout_s: float | None = None,
    repro: bool | None = None,
    compile: bool = False,
) -> Diagnosis:
    """Run ``python script ARGS`` in this process under a ``Probe`` and judge what it saw.

    Args:
        steps: stop the script after this many optimizer steps.
        timeout_s: stop the script after this many seconds.
        repro: run it a second time and compare losses (None: only when the run took under 30 s).
        compile: report torch.compile graph breaks and recompilations, compiling the model if the
            script does not.

    Raises:
        ConfigError: the script is missing or does not compile.
    """
    args = list(args or [])
    start = time.perf_counter()
    probe = Probe(max_steps=steps, compiling=compile)
    watch = CompileWatch(force=compile) if compile else None
    if watch is not None:
        with watch:
            outcome = run_script(script, args, probe, timeout_s=timeout_s)
    else:
        outcome = run_script(script, args, probe, timeout_s=timeout_s)
    extra = watch.findings() if watch is not None else []
    summary: dict[str, Any] = {"compared": 0, "runs": 1}
    if repro or (repro is None and outcome.wall_s < REPRO_MAX_S and outcome.error is None):
        finding, summary = check_reproducible(
            script,
            args,
            probe.facts,
            steps=probe.facts.steps if outcome.stopped else steps,
            timeout_s=max(60.0, 3 * outcome.wall_s + 30),
        )
        if finding is not None:
            extra.append(finding)
    findings = judge(probe.facts, outcome, extra)
    return Diagnosis(findings, outcome, probe.facts, summary, time.perf_counter() - start)


__all__ = ["FINDING_IDS", "Diagnosis", "Finding", "diagnose_script", "order_findings"]
