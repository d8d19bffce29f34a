"""Prometheus metrics: Triton's names and labels where Triton has them, ``torchkeel_*`` for the rest.

Triton exposes its counters without the ``_total`` suffix that ``prometheus_client`` adds, so
those are rendered by a small collector with the exact names, so that existing Triton dashboards
work unchanged. Every server has its own registry (tests run several in one process).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.core import Metric

from torchkeel.serve.drift import DriftMonitor

# Triton's counters: name → help.
TRITON_COUNTERS = {
    "nv_inference_request_success": "Number of successful inference requests, all batch sizes",
    "nv_inference_request_failure": "Number of failed inference requests, all batch sizes (label: reason)",
    "nv_inference_count": "Number of inferences performed (samples; a batch of N counts N)",
    "nv_inference_exec_count": "Number of model executions performed (batches)",
    "nv_inference_request_duration_us": "Cumulative inference request duration in microseconds",
    "nv_inference_queue_duration_us": "Cumulative inference queuing duration in microseconds",
    "nv_inference_compute_infer_duration_us": "Cumulative compute inference duration in microseconds",
}


# Triton's failure reasons: queue full or timed out, cancelled, the model failed, anything else
# (for us: an invalid request).
FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")


class ServerMetrics:
    """The metrics of one model served by one server."""

    def __init__(self, model: str, version: str, drift: DriftMonitor | None,
                 pending: Callable[[], int] = lambda: 0) -> None:
        self.labels = {"model": model, "version": version}
        self.registry = CollectorRegistry()
        self._counts: dict[tuple[str, tuple[tuple[str, str], ...]], float] = defaultdict(float)
        self._lock = threading.Lock()
        self.pending = pending  # read at scrape time: requests queued or being computed
        self.drift = drift
        self.registry.register(_Collector(self))
        self.batch_size = Histogram("torchkeel_batch_size", "Samples per model execution", ["model"],
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=self.registry)
        self.latency = Histogram("torchkeel_request_latency_seconds", "Request latency, received to answered",
                                 ["model", "protocol"], registry=self.registry,
                                 buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        self.in_flight = Gauge("torchkeel_inflight_requests", "Requests being handled", ["model"], registry=self.registry)

    def add(self, name: str, value: float = 1.0, **extra: str) -> None:
        key = (name, tuple(sorted({**self.labels, **extra}.items())))
        with self._lock:
            self._counts[key] += value

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Collector:
    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Any:
        m = self.metrics
        with m._lock:
            counts = dict(m._counts)
        for name, help_text in TRITON_COUNTERS.items():
            family = Metric(name, help_text, "counter")
            label_sets = [{}] if name != "nv_inference_request_failure" else [{"reason": r} for r in FAILURE_REASONS]
            for extra in label_sets:  # every series exists from the start, at 0
                key = (name, tuple(sorted({**m.labels, **extra}.items())))
                counts.setdefault(key, 0.0)
            for (n, labels), value in sorted(counts.items()):
                if n == name:
                    family.add_sample(name, dict(labels), value)
            yield family
        pending = Metric("nv_inference_pending_request_count", "Instantaneous number of pending requests awaiting execution", "gauge")
        pending.add_sample("nv_inference_pending_request_count", dict(m.labels), m.pending())
        yield pending
        if m.drift is not None:
            reading = m.drift.read()
            psi = Metric("torchkeel_input_psi", "Population stability index of recent inputs vs training, per feature", "gauge")
            outside = Metric("torchkeel_input_out_of_range_ratio", "Share of recent input values outside the training range", "gauge")
            for i, (p, o) in enumerate(zip(reading["psi"], reading["out_of_range"])):
                psi.add_sample("torchkeel_input_psi", {"model": m.labels["model"], "feature": str(i)}, p)
                outside.add_sample("torchkeel_input_out_of_range_ratio", {"model": m.labels["model"], "feature": str(i)}, o)
            alert = Metric("torchkeel_drift_alert", "1 when any feature's PSI is above 0.25", "gauge")
            alert.add_sample("torchkeel_drift_alert", {"model": m.labels["model"]}, float(reading["alert"]))
            yield from (psi, outside, alert)
