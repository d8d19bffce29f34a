"""Reference statistics of the training inputs, kept in ``model.json`` for drift monitoring.

Per feature for flat inputs ``[N, F]``, per channel for ``[N, C, ...]`` inputs: mean, std, min,
max, and a histogram (bin edges and counts) that the server compares live traffic against.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def feature_matrix(inputs: np.ndarray) -> np.ndarray:
    """``[N, F]``: flat inputs as they are; ``[N, C, ...]`` inputs as one column per channel."""
    if inputs.ndim == 1:
        return inputs.reshape(-1, 1)
    if inputs.ndim == 2:
        return inputs
    channels = inputs.shape[1]
    return np.moveaxis(inputs, 1, -1).reshape(-1, channels)


def reference_stats(inputs: np.ndarray, num_bins: int = 10) -> dict[str, Any]:
    """Statistics of a sample of training inputs (first dimension: samples)."""
    columns = feature_matrix(np.asarray(inputs, dtype=np.float64))
    per_feature = []
    for column in columns.T:
        low, high = float(column.min()), float(column.max())
        if high <= low:
            high = low + 1e-6
        counts, edges = np.histogram(column, bins=num_bins, range=(low, high))
        per_feature.append(
            {
                "mean": float(column.mean()),
                "std": float(column.std()),
                "min": low,
                "max": high,
                "bin_edges": edges.tolist(),
                "bin_counts": counts.tolist(),
            }
        )
    return {
        "layout": "flat" if np.asarray(inputs).ndim <= 2 else "channels",
        "num_samples": int(np.asarray(inputs).shape[0]),
        "features": per_feature,
    }
