"""Prometheus metrics: Triton's names and labels where Triton has them, ``torchkeel_*`` for the rest.

Triton exposes its counters without the ``_total`` suffix, with ``# HELP``/``# TYPE`` lines that
name the samples. ``prometheus_client`` would add ``_total`` to those lines (and Prometheus would
then read the samples as untyped), so the Triton counters are rendered here as Triton renders
them, so that existing Triton dashboards work unchanged; everything else goes through the
registry. Every server has its own registry (tests run several in one process).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
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
PROTOCOLS = ("v1", "v2", "grpc", "generate", "openai")

_Key = tuple[str, tuple[tuple[str, str], ...]]


class ServerMetrics:
    """The metrics of every model one server serves, in one registry (one family per name)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._counts: dict[_Key, float] = defaultdict(float)
        self._lock = threading.Lock()
        self.models: list[ModelMetrics] = []
        self.registry.register(_Collector(self))
        self.batch_size = Histogram(
            "torchkeel_batch_size",
            "Samples per model execution",
            ["model", "version"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
            registry=self.registry,
        )
        self.latency = Histogram(
            "torchkeel_request_latency_seconds",
            "Request latency, received to answered",
            ["model", "version", "protocol"],
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
        )
        self.generated = Counter(
            "torchkeel_generation_tokens",
            "Tokens generated (end-of-text included)",
            ["model", "version"],
            registry=self.registry,
        )
        self.prompt = Counter(
            "torchkeel_prompt_tokens", "Prompt tokens read by generation", ["model", "version"], registry=self.registry
        )
        self.first_token = Histogram(
            "torchkeel_time_to_first_token_seconds",
            "Generation: request received to its first token",
            ["model", "version"],
            registry=self.registry,
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
        self.per_token = Histogram(
            "torchkeel_time_per_output_token_seconds",
            "Generation: time between a request's consecutive tokens",
            ["model", "version"],
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1),
        )
        self.in_flight = Gauge(
            "torchkeel_inflight_requests", "Requests being handled", ["model", "version"], registry=self.registry
        )
        self.running = Gauge(
            "torchkeel_generation_running_sequences",
            "Generation: sequences in the engine's batch (a request of n choices counts n)",
            ["model", "version"],
            registry=self.registry,
        )

    def answered(self) -> tuple[int, int, int]:
        """Requests answered so far, how many of them failed, and how many were read but not
        answered (in flight), over every model and protocol."""
        with self._lock:
            done = [(name, n) for (name, _), n in self._counts.items() if name.startswith("nv_inference_request_")]
            in_flight = sum(m.requests_in_flight for m in self.models)
        ok = sum(n for name, n in done if name == "nv_inference_request_success")
        failed = sum(n for name, n in done if name == "nv_inference_request_failure")
        return int(ok + failed), int(failed), in_flight

    def model(
        self, name: str, version: str, drift: DriftMonitor | None = None, pending: Callable[[], int] = lambda: 0
    ) -> ModelMetrics:
        """The metrics of one model (labels ``model`` and ``version``, as Triton's)."""
        metrics = ModelMetrics(self, name, version, drift, pending)
        self.models.append(metrics)
        return metrics

    def render(self) -> bytes:
        return self._render_triton_counters().encode() + generate_latest(self.registry)

    def _render_triton_counters(self) -> str:
        with self._lock:
            counts = dict(self._counts)
        lines = []
        for name, help_text in TRITON_COUNTERS.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
            label_sets = [{}] if name != "nv_inference_request_failure" else [{"reason": r} for r in FAILURE_REASONS]
            for model in self.models:  # every series exists from the start, at 0
                for extra in label_sets:
                    counts.setdefault((name, tuple(sorted({**model.labels, **extra}.items()))), 0.0)
            for (n, labels), value in sorted(counts.items()):
                if n == name:
                    text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
                    lines.append(f"{name}{{{text}}} {float(value)!r}")
        return "\n".join(lines) + "\n"


class ModelMetrics:
    """One model's counters and histogram children, bound once: the request path only adds numbers."""

    def __init__(
        self, server: ServerMetrics, model: str, version: str, drift: DriftMonitor | None, pending: Callable[[], int]
    ) -> None:
        self.server = server
        self.labels = {"model": model, "version": version}
        self.pending = pending  # read at scrape time: requests queued or being computed
        self.drift = drift
        self.requests_in_flight = 0
        server.in_flight.labels(model, version).set_function(lambda: self.requests_in_flight)
        self._batch_size = server.batch_size.labels(model, version)
        self._latency = {p: server.latency.labels(model, version, p) for p in PROTOCOLS}
        self._keys: dict[tuple[str, str | None], _Key] = {}
        key = self._key
        self._success, self._duration = key("nv_inference_request_success"), key("nv_inference_request_duration_us")
        self._exec, self._count = key("nv_inference_exec_count"), key("nv_inference_count")
        self._compute, self._queue = (
            key("nv_inference_compute_infer_duration_us"),
            key("nv_inference_queue_duration_us"),
        )

    def generation(self) -> GenerationMetrics:
        """The generation figures of this model (tokens, time to first token, time per token)."""
        server, (model, version) = self.server, self.labels.values()
        return GenerationMetrics(
            server.generated.labels(model, version),
            server.prompt.labels(model, version),
            server.first_token.labels(model, version),
            server.per_token.labels(model, version),
            server.running.labels(model, version),
        )

    def request_started(self) -> None:
        with self.server._lock:  # also called from gRPC's handler threads
            self.requests_in_flight += 1

    def request_done(self, protocol: str, seconds: float, failure: str | None = None) -> None:
        """One request answered: success or failure (Triton's ``reason``), its duration."""
        outcome = self._success if failure is None else self._key("nv_inference_request_failure", failure)
        with self.server._lock:
            self.requests_in_flight -= 1
            counts = self.server._counts
            counts[outcome] += 1
            counts[self._duration] += seconds * 1e6
        self._latency[protocol].observe(seconds)

    def batch_done(self, batch_size: int, num_requests: int, compute_s: float, queue_s: float) -> None:
        """One model execution: its samples, requests, compute time and the requests' total queue time."""
        with self.server._lock:
            counts = self.server._counts
            counts[self._exec] += 1
            counts[self._count] += batch_size
            counts[self._compute] += compute_s * 1e6 * num_requests
            counts[self._queue] += queue_s * 1e6
        self._batch_size.observe(batch_size)

    def _key(self, name: str, reason: str | None = None) -> _Key:
        key = self._keys.get((name, reason))
        if key is None:
            labels = {**self.labels, **({"reason": reason} if reason else {})}
            key = self._keys[(name, reason)] = (name, tuple(sorted(labels.items())))
        return key


class GenerationMetrics:
    """What the generation engine counts, bound to one model's series."""

    def __init__(self, generated: Any, prompt: Any, first_token: Any, per_token: Any, running: Any) -> None:
        self._generated, self._prompt, self._first, self._per_token = generated, prompt, first_token, per_token
        self._running = running

    def tokens(self, count: int) -> None:
        self._generated.inc(count)

    def prompt_tokens(self, count: int) -> None:
        self._prompt.inc(count)

    def first_token(self, seconds: float) -> None:
        self._first.observe(seconds)

    def output_token(self, seconds: float) -> None:
        self._per_token.observe(seconds)

    def running(self, count: int) -> None:
        """The sequences being decoded now (set after every step: a row gone from the batch is gone here)."""
        self._running.set(count)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class _Collector:
    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Any:
        models = self.metrics.models
        pending = Metric(
            "nv_inference_pending_request_count", "Instantaneous number of pending requests awaiting execution", "gauge"
        )
        for m in models:
            pending.add_sample("nv_inference_pending_request_count", dict(m.labels), m.pending())
        yield pending
        drifting = [m for m in models if m.drift is not None]
        if not drifting:
            return
        psi = Metric(
            "torchkeel_input_psi", "Population stability index of recent inputs vs training, per feature", "gauge"
        )
        outside = Metric(
            "torchkeel_input_out_of_range_ratio", "Share of recent input values outside the training range", "gauge"
        )
        score = Metric(
            "torchkeel_input_drift_score",
            "Chi-square drift statistic per feature over its critical value (above 1: drifted)",
            "gauge",
        )
        samples = Metric("torchkeel_drift_window_samples", "Samples in the drift window", "gauge")
        alert = Metric(
            "torchkeel_drift_alert",
            "1 when the window holds enough samples and any feature's "
            "drift score is above 1 (false alarms at most 1e-6 per reading)",
            "gauge",
        )
        for m in drifting:
            assert m.drift is not None
            reading = m.drift.read()
            for i, (p, o, value) in enumerate(zip(reading["psi"], reading["out_of_range"], reading["score"])):
                labels = {**m.labels, "feature": str(i)}
                psi.add_sample("torchkeel_input_psi", labels, p)
                outside.add_sample("torchkeel_input_out_of_range_ratio", labels, o)
                score.add_sample("torchkeel_input_drift_score", labels, value)
            samples.add_sample("torchkeel_drift_window_samples", dict(m.labels), reading["samples"])
            alert.add_sample("torchkeel_drift_alert", dict(m.labels), float(reading["alert"]))
        yield from (psi, outside, score, samples, alert)
