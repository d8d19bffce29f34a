"""Run reports: metrics, incidents and summary as charts and one HTML page."""

from torchkeel.report.build import Report, build_report

__all__ = ["Report", "build_report"]
