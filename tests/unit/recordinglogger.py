"""A logger for the tests: keeps what it was given (the protocol's three methods)."""

from __future__ import annotations

RECORDED: list["Recording"] = []


class Recording:
    def __init__(self, run_dir, config) -> None:
        self.run_dir, self.config = run_dir, config
        self.metrics: list[tuple[int, dict]] = []
        self.incidents: list[dict] = []
        self.closed = False
        RECORDED.append(self)

    def log_metrics(self, step, values) -> None:
        self.metrics.append((step, dict(values)))

    def log_incident(self, row) -> None:
        self.incidents.append(row)

    def close(self) -> None:
        self.closed = True


def not_a_logger(run_dir, config):
    return object()
