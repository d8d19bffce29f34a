"""Input drift against the training reference in ``model.json``, with a known false-alarm rate.

Per feature (or channel), over a sliding window of the most recent samples:

- ``out_of_range``: the share of values outside the training [min, max];
- ``psi``: the population stability index against the training histogram (descriptive only:
  from tens of samples it is mostly noise, so it never raises the alert on its own);
- ``score``: a two-sample chi-square test of homogeneity between the window's histogram and the
  training one, divided by its critical value. Sparse tail bins are merged until each holds at
  least 10 % of the training samples, so that every expected count is at least 10 once the window
  holds ``min_samples``. The test compares against the reference *sample* (its counts), so the
  noise in the reference histogram itself is accounted for.

``alert`` is raised when the window holds at least ``min_samples`` samples and any feature's
score is above 1. The critical values use a Bonferroni correction over the features, so that
under in-distribution traffic one reading alerts with probability at most
``false_alarm_rate`` (default 1e-6), however many features the model has. The window is the
last 300 samples (``window_samples``): short enough that a shift fills it within a few hundred
requests, long enough for the test.

For image-like inputs (``[N, C, ...]``) the pixels of one sample are not independent draws: each
sample counts once, its pixels spread over the bins, in the window as in the reference. The
window reads each sample's pixels at a fixed grid of at most 1,024 positions per channel. Likewise
repeats of one input are not new evidence: the test weighs the window's shares by its number of
distinct samples, but at least 20 (so a client cycling through its validation set raises no
alarm, while a shift of those same inputs does, and so does a stream stuck on one input).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from statistics import NormalDist
from typing import Any

import numpy as np

from torchkeel.export.stats import feature_matrix

MIN_BIN_SHARE = 0.1  # of the training samples, per merged bin
MIN_EXPECTED = 10.0  # expected window count per merged bin before the test is trusted
CHUNK_SAMPLES = 64
MIN_DISTINCT = 20  # the least weight a window's samples have in the test, however repetitive
MAX_POSITIONS = 1024  # per sample and channel of an image: a fixed grid of at most this many pixels
_EPS = 1e-4


class DriftMonitor:
    """Accumulates per-feature bin counts of recent inputs; reads out drift per feature and the alert."""

    def __init__(self, reference: dict[str, Any], window_samples: int = 300, false_alarm_rate: float = 1e-6) -> None:
        features = reference["features"]
        edges = np.array([f["bin_edges"] for f in features], dtype=np.float64)  # equal-width bins
        self.num_features, self.num_bins = edges.shape[0], edges.shape[1] - 1
        self.edges0 = edges[:, 0]
        self.width = (edges[:, -1] - edges[:, 0]) / self.num_bins
        self.low = np.array([f["min"] for f in features])
        self.high = np.array([f["max"] for f in features])
        counts = np.array([f["bin_counts"] for f in features], dtype=np.float64)
        self.reference = (counts + _EPS) / (counts + _EPS).sum(axis=1, keepdims=True)
        # One reference sample per training sample, also for images (see the module docstring).
        num_samples = float(reference.get("num_samples") or counts.sum(axis=1).max())
        self.reference_counts = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1) * num_samples
        self.groups = [_merge_bins(row / max(row.sum(), 1)) for row in counts]
        min_share = min(
            (min(_group_sums(row / max(row.sum(), 1), g)) for row, g in zip(counts, self.groups) if len(g) > 1),
            default=1.0,
        )
        self.min_samples = max(30, math.ceil(MIN_EXPECTED / min_share))
        per_feature = false_alarm_rate / self.num_features  # Bonferroni
        self.critical = np.array(
            [chi2_quantile(1 - per_feature, len(g) - 1) if len(g) > 1 else math.inf for g in self.groups]
        )
        self.window_samples = window_samples
        self._pending: list[np.ndarray] = []  # batches not yet binned: binning is done in chunks
        self._pending_samples = 0
        self._window: deque[tuple[np.ndarray, np.ndarray, int, list[int]]] = deque()
        self._distinct: Counter[int] = Counter()  # hashes of the window's samples → occurrences
        self._counts = np.zeros((self.num_features, self.num_bins))
        self._outside = np.zeros(self.num_features)
        self._samples = 0

    def observe(self, inputs: np.ndarray) -> None:
        """Record a batch of inputs (first dimension: samples).

        Cheap on the request path: batches are kept (by reference) and binned together once
        ``CHUNK_SAMPLES`` have come, or when the monitor is read.
        """
        self._pending.append(_subsampled(inputs))  # images: a small copy, not the batch
        self._pending_samples += len(inputs)
        if self._pending_samples >= CHUNK_SAMPLES:
            self._bin_pending()

    def _bin_pending(self) -> None:
        if not self._pending:
            return
        inputs = np.concatenate(self._pending).astype(np.float64, copy=False)
        self._pending, self._pending_samples = [], 0
        samples = inputs.shape[0]
        if samples == 0:
            return
        columns = feature_matrix(inputs)
        values_per_sample = columns.shape[0] // samples
        # Values outside the training range count in the outermost bins (and as out of range).
        bins = np.clip(((columns - self.edges0) / self.width).astype(np.int64), 0, self.num_bins - 1)
        flat = (bins + np.arange(self.num_features) * self.num_bins).ravel()
        counts = np.bincount(flat, minlength=self.num_features * self.num_bins).reshape(
            self.num_features, self.num_bins
        )
        counts = counts / values_per_sample
        outside = ((columns < self.low) | (columns > self.high)).sum(axis=0) / values_per_sample
        keys = [hash(row.tobytes()) for row in inputs.reshape(samples, -1)]
        self._window.append((counts, outside, samples, keys))
        self._counts += counts
        self._outside += outside
        self._samples += samples
        self._distinct.update(keys)
        while self._samples - self._window[0][2] >= self.window_samples:
            old_counts, old_outside, old_samples, old_keys = self._window.popleft()
            self._counts -= old_counts
            self._outside -= old_outside
            self._samples -= old_samples
            self._distinct.subtract(old_keys)
            for key in old_keys:
                if self._distinct[key] <= 0:
                    del self._distinct[key]

    def read(self) -> dict[str, Any]:
        """Per feature ``psi``, ``out_of_range`` and ``score`` over the window; ``alert``; ``samples``."""
        self._bin_pending()
        n = self.num_features
        if self._samples == 0:
            return {
                "psi": [0.0] * n,
                "out_of_range": [0.0] * n,
                "score": [0.0] * n,
                "alert": False,
                "samples": 0,
                "distinct_samples": 0,
            }
        counts = np.maximum(self._counts, 0.0)  # running sums: clear float residue below 0
        live = (counts + _EPS) / (counts + _EPS).sum(axis=1, keepdims=True)
        psi = ((live - self.reference) * np.log(live / self.reference)).sum(axis=1)
        # Repeats of one input are not independent evidence: the window's shares count at the
        # weight of its distinct samples (a client that cycles through a small set of inputs),
        # but at least MIN_DISTINCT's, so that a stream stuck on one input is still drift.
        weight = min(self._samples, max(len(self._distinct), MIN_DISTINCT))
        distinct = counts * (weight / self._samples)
        statistic = np.array(
            [_homogeneity(self.reference_counts[i], distinct[i], g) for i, g in enumerate(self.groups)]
        )
        score = np.where(np.isfinite(self.critical), statistic / self.critical, 0.0)
        alert = self._samples >= self.min_samples and bool((score > 1.0).any())
        return {
            "psi": psi.tolist(),
            "out_of_range": (self._outside / self._samples).tolist(),
            "score": score.tolist(),
            "alert": alert,
            "samples": int(self._samples),
            "distinct_samples": len(self._distinct),
        }


def _subsampled(inputs: np.ndarray) -> np.ndarray:
    """Image-like inputs ``[N, C, ...]`` at a fixed grid of at most ``MAX_POSITIONS`` positions per
    channel: a sample's share of each bin is read from those pixels, so that binning a chunk of
    224×224 images costs milliseconds, not a stall of the event loop."""
    if inputs.ndim <= 2:
        return inputs
    flat = inputs.reshape(inputs.shape[0], inputs.shape[1], -1)
    stride = -(-flat.shape[2] // MAX_POSITIONS)
    return np.ascontiguousarray(flat[:, :, ::stride]) if stride > 1 else flat


def chi2_quantile(q: float, df: int) -> float:
    """The ``q`` quantile of the chi-square distribution (Wilson–Hilferty; within a few % in the tail)."""
    z = NormalDist().inv_cdf(q)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _merge_bins(shares: np.ndarray) -> list[list[int]]:
    """Adjacent bins grouped so that each group holds at least ``MIN_BIN_SHARE`` of the reference."""
    groups: list[list[int]] = []
    current: list[int] = []
    mass = 0.0
    for i, share in enumerate(shares):
        current.append(i)
        mass += share
        if mass >= MIN_BIN_SHARE:
            groups.append(current)
            current, mass = [], 0.0
    if current:
        if groups:
            groups[-1].extend(current)
        else:
            groups.append(current)
    return groups


def _group_sums(values: np.ndarray, groups: list[list[int]]) -> np.ndarray:
    return np.array([values[g].sum() for g in groups])


def _homogeneity(reference: np.ndarray, window: np.ndarray, groups: list[list[int]]) -> float:
    """Pearson's chi-square statistic for two samples sharing one distribution over ``groups``."""
    if len(groups) < 2:
        return 0.0
    table = np.stack([_group_sums(reference, groups), _group_sums(window, groups)])
    totals = table.sum(axis=1, keepdims=True)
    expected = totals * table.sum(axis=0, keepdims=True) / max(table.sum(), 1e-12)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(expected > 0, (table - expected) ** 2 / expected, 0.0)
    return float(terms.sum())
