"""Parity: the exported model must answer like the eager one, at every batch size checked."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from torchkeel.errors import first_line

TOLERANCE = 1e-5


def check_parity(
    model: torch.nn.Module,
    run_exported: Callable[[np.ndarray], np.ndarray],
    samples: torch.Tensor,
    batch_sizes: Sequence[int],
    tolerance: float = TOLERANCE,
) -> dict[str, Any]:
    """Compare eager and exported outputs on real samples at each batch size.

    A batch size larger than the samples repeats them. An exported model that raises at some
    batch size (a trace that hard-coded the batch) fails there. Returns the report that goes
    into ``model.json``: per batch size the max abs error (or the error), the worst case, and
    ``passed``.
    """
    model = model.eval()
    results, worst = [], None
    for size in batch_sizes:
        batch = samples[torch.arange(size) % len(samples)]
        with torch.inference_mode():
            expected = model(batch).float().numpy()
        entry: dict[str, Any] = {"batch_size": size}
        try:
            got = np.asarray(run_exported(batch.numpy()))
            if got.shape != expected.shape:
                raise ValueError(f"output shape {list(got.shape)}, eager {list(expected.shape)}")
            entry["max_abs_error"] = float(np.max(np.abs(got.astype(np.float64) - expected))) if got.size else 0.0
        except Exception as exc:  # noqa: BLE001 - any failure of the artifact is a parity failure
            entry["error"] = f"{type(exc).__name__}: {first_line(exc)}"
            entry["max_abs_error"] = float("inf")
        entry["passed"] = entry["max_abs_error"] <= tolerance
        results.append(entry)
        if worst is None or entry["max_abs_error"] > worst["max_abs_error"]:
            worst = entry
    assert worst is not None, "batch_sizes must not be empty"
    return {
        "tolerance": tolerance,
        "output": "output",
        "results": results,
        "worst": worst,
        "passed": all(entry["passed"] for entry in results),
    }


def describe(report: dict[str, Any]) -> str:
    """One line: passed, or the worst batch size and error."""
    w = report["worst"]
    if report["passed"]:
        return (f"parity passed: max abs error {w['max_abs_error']:.2e} <= {report['tolerance']:g} at batch sizes "
                f"{', '.join(str(r['batch_size']) for r in report['results'])}")
    what = w.get("error") or f"max abs error {w['max_abs_error']:.3g} > {report['tolerance']:g}"
    return f"parity FAILED on output '{report['output']}' at batch size {w['batch_size']}: {what}"
