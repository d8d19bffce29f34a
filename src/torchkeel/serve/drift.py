"""Input drift against the training reference in ``model.json``.

Per feature (or channel): the share of recent values outside the training [min, max], and the
population stability index (PSI) of the recent values' histogram over the training bins,
both over a sliding window of requests. PSI above 0.25 is the usual "significant shift" mark.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from torchkeel.export.stats import feature_matrix

PSI_ALERT = 0.25
_EPS = 1e-4


class DriftMonitor:
    """Accumulates per-feature bin counts of recent inputs; reads out PSI and out-of-range shares."""

    def __init__(self, reference: dict[str, Any], window_requests: int = 500) -> None:
        features = reference["features"]
        edges = np.array([f["bin_edges"] for f in features], dtype=np.float64)  # equal-width bins
        self.num_features, self.num_bins = edges.shape[0], edges.shape[1] - 1
        self.edges0 = edges[:, 0]
        self.width = (edges[:, -1] - edges[:, 0]) / self.num_bins
        self.low = np.array([f["min"] for f in features])
        self.high = np.array([f["max"] for f in features])
        ref = np.array([f["bin_counts"] for f in features], dtype=np.float64)
        self.reference = (ref + _EPS) / (ref + _EPS).sum(axis=1, keepdims=True)
        self.window: deque[tuple[np.ndarray, np.ndarray, int]] = deque(maxlen=window_requests)

    def observe(self, inputs: np.ndarray) -> None:
        """Record one request's inputs (first dimension: samples)."""
        columns = feature_matrix(np.asarray(inputs, dtype=np.float64))
        # Values outside the training range count in the outermost bins (and as out of range).
        bins = np.clip(((columns - self.edges0) / self.width).astype(np.int64), 0, self.num_bins - 1)
        flat = (bins + np.arange(self.num_features) * self.num_bins).ravel()
        counts = np.bincount(flat, minlength=self.num_features * self.num_bins).reshape(self.num_features, self.num_bins)
        out_of_range = ((columns < self.low) | (columns > self.high)).sum(axis=0)
        self.window.append((counts, out_of_range, columns.shape[0]))

    def read(self) -> dict[str, Any]:
        """``psi`` and ``out_of_range`` per feature over the window, and ``alert`` (any PSI > 0.25)."""
        if not self.window:
            n = self.num_features
            return {"psi": [0.0] * n, "out_of_range": [0.0] * n, "alert": False, "samples": 0}
        counts = sum(c for c, _, _ in self.window)
        outside = sum(o for _, o, _ in self.window)
        samples = sum(n for _, _, n in self.window)
        live = (counts + _EPS) / (counts + _EPS).sum(axis=1, keepdims=True)
        psi = ((live - self.reference) * np.log(live / self.reference)).sum(axis=1)
        return {"psi": psi.tolist(), "out_of_range": (outside / samples).tolist(),
                "alert": bool((psi > PSI_ALERT).any()), "samples": int(samples)}
