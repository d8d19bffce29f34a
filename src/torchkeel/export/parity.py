"""Parity: the exported model must answer like the eager one, at every batch size checked."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from torchkeel.errors import first_line

TOLERANCE = 1e-5
"""Absolute part of the allowed difference (fp32)."""
RTOL = 1.3e-6
"""Relative part, times the eager output's magnitude (``torch.testing``'s fp32 default): the
logits of a language model are tens, and their float rounding grows with them."""


def check_parity(
    model: torch.nn.Module,
    run_exported: Callable[[Any], np.ndarray],
    samples: torch.Tensor | Mapping[str, torch.Tensor],
    batch_sizes: Sequence[int],
    tolerance: float = TOLERANCE,
    rtol: float = RTOL,
    other_shapes: Sequence[Mapping[str, torch.Tensor]] = (),
    output: str = "output",
) -> dict[str, Any]:
    """Compare eager and exported outputs on real samples at each batch size: every element
    within ``tolerance + rtol * |eager|``.

    ``samples`` is one input tensor, or the inputs by name (``model`` takes them positionally,
    in that order). A batch size larger than the samples repeats them. ``other_shapes``: batches
    whose dynamic axes (a padded sequence) have other sizes, checked as they are. An exported
    model that raises at some batch size or shape (a trace that hard-coded it) fails there.
    Returns the report that goes into ``model.json``: per check the max abs error (or the
    error), its largest share of the allowed difference (1.0: at the limit), the worst case, and
    ``passed``.
    """
    model = model.eval()
    feeds = samples if isinstance(samples, Mapping) else {"input": samples}
    count = len(next(iter(feeds.values())))
    checks = [(size, {k: v[torch.arange(size) % count] for k, v in feeds.items()}) for size in batch_sizes]
    checks += [(len(next(iter(feed.values()))), dict(feed)) for feed in other_shapes]
    results, worst = [], None
    for index, (size, feed) in enumerate(checks):
        with torch.inference_mode():
            expected = model(*feed.values()).float().numpy()
        entry: dict[str, Any] = {"batch_size": size}
        if index >= len(batch_sizes):
            entry["shapes"] = {name: list(t.shape) for name, t in feed.items()}
        try:
            given = {name: t.numpy() for name, t in feed.items()}
            got = np.asarray(run_exported(given if isinstance(samples, Mapping) else given["input"]))
            if got.shape != expected.shape:
                raise ValueError(f"output shape {list(got.shape)}, eager {list(expected.shape)}")
            difference = np.abs(got.astype(np.float64) - expected)
            share = difference / (tolerance + rtol * np.abs(expected.astype(np.float64)))
            entry["max_abs_error"] = float(difference.max()) if got.size else 0.0
            entry["max_share"] = float(np.nan_to_num(share, nan=np.inf).max()) if got.size else 0.0
        except Exception as exc:  # noqa: BLE001 - any failure of the artifact is a parity failure
            entry["error"] = f"{type(exc).__name__}: {first_line(exc)}"
            entry["max_abs_error"] = entry["max_share"] = float("inf")
        entry["passed"] = entry["max_share"] <= 1.0
        results.append(entry)
        if worst is None or entry["max_share"] > worst["max_share"]:
            worst = entry
    assert worst is not None, "batch_sizes must not be empty"
    return {
        "tolerance": tolerance,
        "rtol": rtol,
        "output": output,
        "results": results,
        "worst": worst,
        "passed": all(entry["passed"] for entry in results),
    }


def describe(report: dict[str, Any]) -> str:
    """One line: passed, or the worst batch size and error."""
    w = report["worst"]
    if report["passed"]:
        sizes = [str(r["batch_size"]) for r in report["results"] if "shapes" not in r]
        shapes = sum("shapes" in r for r in report["results"])
        return (
            f"parity passed: max abs error {w['max_abs_error']:.2e} within {_allowed(report)} at batch sizes "
            f"{', '.join(sizes)}" + (f" and {shapes} other input shape{'s' * (shapes > 1)}" if shapes else "")
        )
    what = w.get("error") or (
        f"max abs error {w['max_abs_error']:.3g}, {w.get('max_share', float('nan')):.3g}x what {_allowed(report)} allows"
    )
    shapes = f" (input shapes {w['shapes']})" if "shapes" in w else ""
    return f"parity FAILED on output '{report['output']}' at batch size {w['batch_size']}{shapes}: {what}"


def _allowed(report: dict[str, Any]) -> str:
    """The allowed difference, as a person reads it (reports before ``rtol`` have only ``tolerance``)."""
    rtol = report.get("rtol", 0.0)
    return f"{report['tolerance']:g}" + (f" + {rtol:g}*|eager|" if rtol else "")
