"""``build_report``: a run directory's metrics, incidents and summary as PNG charts and one HTML page.

It reads whatever is there — a run still going, or killed mid-line — and says what is missing
instead of failing. Charts share the step axis. Resumes, rollbacks and a preemption are marked
on every timeline; each other incident kind on the chart it explains (non-finite steps and
spikes on the loss and gradient norm, waiting for data and OOM splits on the throughput, leaks
on memory), in a colour of its own with its count in the legend. Bad samples and any kind that
happened many times are ticks along the bottom of the chart, not lines across it. What the run
warned of that is no incident (clipping that rescaled most of the first steps) is listed at the
top, under Warnings, and marked on the gradient-norm and clipping charts.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from torchkeel.errors import MissingExtraError
from torchkeel.train.profiling import describe, read_summary
from torchkeel.train.runlog import read_metrics

FIGSIZE, DPI = (8.0, 3.0), 100  # every chart is 800 × 300 pixels
MARKERS = {
    "nonfinite": "tab:red",
    "rollback": "tab:purple",
    "oom_split": "tab:orange",
    "leak": "tab:brown",
    "spike": "tab:pink",
    "memory": "tab:olive",
    "resume": "tab:green",
    "preempted": "black",
    "bad_sample": "tab:gray",
    "input_bound": "tab:cyan",
    "graph_break": "tab:blue",
    "compile": "navy",
    "clipping": "darkgoldenrod",
}
SPARE_COLOURS = ("gold", "teal", "maroon", "lime", "indigo", "coral")  # kinds this table does not know yet
EVERY_CHART = ("resume", "rollback", "preempted")
CHART_KINDS = {
    "loss": ("nonfinite", "spike", "bad_sample", "graph_break", "compile"),
    "val_metrics": (),
    "lr": (),
    "grad_norm": ("nonfinite", "spike", "clipping"),
    "clip_frac": ("clipping",),
    "throughput": ("input_bound", "oom_split", "compile"),
    "tokens": ("input_bound", "oom_split", "compile"),
    "memory": ("leak", "memory", "oom_split"),
}
AS_TICKS = ("bad_sample",)  # per-sample events: ticks along the bottom
MAX_LINES = 12  # a kind with more marks than this on a chart is drawn as ticks too
CHARTS = [
    ("loss", "Loss", [("train", "loss", "train loss"), ("val", "val_loss", "validation loss")], False),
    ("val_metrics", "Validation metrics", [], False),  # every val_* metric the run logged but the loss
    ("lr", "Learning rate", [("train", "lr", "lr")], False),
    ("grad_norm", "Gradient norm (before clipping)", [("train", "grad_norm", "grad norm")], True),
    ("clip_frac", "Steps rescaled by clipping (share of each log window)", [("train", "clip_frac", "clipped")], False),
    ("throughput", "Throughput (samples/s)", [("train", "samples_per_s", "samples/s")], False),
    ("tokens", "Throughput (tokens/s)", [("train", "tokens_per_s", "tokens/s")], False),
    (
        "memory",
        "Memory (GiB)",
        [
            ("memory", "rss_bytes", "process RSS"),
            ("memory", "cuda_allocated_bytes", "CUDA allocated"),
            ("memory", "cuda_reserved_bytes", "CUDA reserved"),
        ],
        False,
    ),
]


@dataclass
class Report:
    path: Path
    images: list[Path] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    marks: list[tuple[int, str]] = field(default_factory=list)  # (step, kind) of every incident and event
    drawn: dict[str, list[str]] = field(default_factory=dict)  # chart → the kinds marked on it
    warnings: list[str] = field(default_factory=list)  # what the run warned of that is no incident


def build_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Report:
    """Write ``report.html`` and its PNGs into ``out_dir`` (default: the run directory)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise MissingExtraError("report", "matplotlib", "keel report") from None
    run = Path(run_dir)
    out = Path(out_dir) if out_dir is not None else run
    out.mkdir(parents=True, exist_ok=True)
    rows = read_metrics(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else []
    incidents = read_metrics(run / "incidents.jsonl") if (run / "incidents.jsonl").exists() else []
    summary = _json(run / "summary.json")
    report = Report(out / "report.html")
    if not (run / "metrics.jsonl").exists():
        report.missing.append("metrics.jsonl (no training step was logged yet)")
    elif not rows:
        report.missing.append("training rows in metrics.jsonl (the file is empty or unreadable)")
    if summary is None:
        report.missing.append("summary.json (the run is still going, or was killed)")
    report.marks = marks = _marks(rows, incidents, summary)
    report.warnings = [str(r.get("message", "")) for r in rows if r.get("kind") == "clipping"]
    val_keys = _val_keys(rows)
    for name, title, series, log_scale in CHARTS:
        if name == "val_metrics":
            series = [("val", key, key[len("val_") :]) for key in val_keys]
        lines = [
            (
                label,
                [(r["step"], r[key]) for r in rows if r.get("kind") == kind and isinstance(r.get(key), (int, float))],
            )
            for kind, key, label in series
        ]
        lines = [(label, points) for label, points in lines if points]
        if name == "grad_norm" and lines:
            lines += _clip_line(run, lines[0][1])
        if not lines:
            if name == "val_metrics" and any(r.get("kind") == "val" for r in rows):
                continue  # validated with val_loss alone, which the loss chart shows
            if name in ("tokens", "clip_frac"):
                continue  # batches that are not token ids; a run that does not clip
            report.missing.append(f"{title.lower()} (no rows with it)")
            continue
        report.drawn[name] = chart_kinds(name, {k for _, k in marks})
        report.images.append(_draw(Figure(figsize=FIGSIZE, dpi=DPI), name, title, lines, log_scale, report, out))
    report.path.write_text(_html(run, summary, incidents, report), encoding="utf-8")
    return report


def _clip_line(run: Path, points: list[tuple[int, float]]) -> list[tuple[str, list[tuple[int, float]]]]:
    """``train.clip_grad_norm`` as a flat line across the gradient-norm chart (none when the run does not clip)."""
    try:
        clip = yaml.safe_load((run / "config.yaml").read_text())["train"]["clip_grad_norm"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return []
    if isinstance(clip, bool) or not isinstance(clip, (int, float)):
        return []
    steps = [step for step, _ in points]
    return [(f"train.clip_grad_norm {clip:g}", [(min(steps), clip), (max(steps), clip)])]


def _marks(rows: list[dict], incidents: list[dict], summary: dict | None) -> list[tuple[int, str]]:
    """The steps to mark on the charts: incidents, resumes and a preemption, in step order."""
    marks = [(r["step"], r["kind"]) for r in incidents if "step" in r]
    marks += [(r["step"], "resume") for r in rows if r.get("kind") == "resume"]
    marks += [(r["step"], "clipping") for r in rows if r.get("kind") == "clipping"]
    if summary and summary.get("status") == "preempted":
        marks.append((summary.get("steps", 0), "preempted"))
    return sorted(marks)


def _val_keys(rows: list[dict]) -> list[str]:
    """The validation metrics besides ``val_loss`` that some row holds a number for."""
    return sorted(
        {
            k
            for r in rows
            if r.get("kind") == "val"
            for k in r
            if k.startswith("val_") and k != "val_loss" and isinstance(r[k], (int, float))
        }
    )


def _draw(
    fig: Any, name: str, title: str, lines: list[tuple[str, list]], log_scale: bool, report: Report, out: Path
) -> Path:
    """Draw one chart's ``lines`` and the run's marks on ``fig``; save it as ``out/<name>.png``."""
    ax = fig.subplots()
    scale = 2**30 if name == "memory" else 1
    for label, points in lines:
        ax.plot(
            [p[0] for p in points],
            [p[1] / scale for p in points],
            label=label,
            marker="." if len(points) < 30 else None,
        )
    draw_marks(ax, report.marks, report.drawn[name])
    values = [p[1] for _, points in lines for p in points]
    if name == "clip_frac":
        ax.set_ylim(-0.02, 1.02)  # a share, on its whole range: 0.95 is not far below 1
    elif log_scale or (min(values) > 0 and max(values) / min(values) > 1e3):
        ax.set_yscale("log")  # a diverging run spans many orders of magnitude
    elif name == "memory":
        ax.set_ylim(*memory_ylim([v / scale for v in values]))
    ax.set_title(title)
    ax.set_xlabel("optimizer step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    path = out / f"{name}.png"
    fig.savefig(path)
    return path


def chart_kinds(chart: str, kinds: set[str]) -> list[str]:
    """The incident kinds drawn on ``chart``: the run's events, its own kinds, and on the loss
    chart any kind no chart claims."""
    claimed = {k for chart_kinds in CHART_KINDS.values() for k in chart_kinds} | set(EVERY_CHART)
    own = (
        set(CHART_KINDS.get(chart, ()))
        | set(EVERY_CHART)
        | ({k for k in kinds if k not in claimed} if chart == "loss" else set())
    )
    return sorted(kinds & own)


def colour(kind: str) -> str:
    """A colour per kind: the table's, else a spare one chosen by the kind's name."""
    return MARKERS.get(kind) or SPARE_COLOURS[sum(map(ord, kind)) % len(SPARE_COLOURS)]


def draw_marks(ax: Any, marks: list[tuple[int, str]], kinds: list[str]) -> None:
    """Each kind in its colour, labelled with its count: a dashed line per step, or — for
    per-sample kinds and kinds with many marks — short ticks along the bottom."""
    for kind in kinds:
        steps = [s for s, k in marks if k == kind]
        label = f"{kind.replace('_', ' ')} ({len(steps)})"
        if kind in AS_TICKS or len(steps) > MAX_LINES:
            ax.plot(
                steps,
                [0.0] * len(steps),
                linestyle="none",
                marker="|",
                markersize=10,
                color=colour(kind),
                transform=ax.get_xaxis_transform(),
                label=label,
                clip_on=False,
            )
        else:
            for i, step in enumerate(steps):
                ax.axvline(step, color=colour(kind), linestyle="--", linewidth=1, label=label if i == 0 else None)


def memory_ylim(values: list[float]) -> tuple[float, float]:
    """A y-range that starts at 0 — so that flat memory looks flat, not like a leak — with room
    above the highest value."""
    return 0.0, max(max(values) * 1.1, 1e-9)


def format_value(value: Any) -> str:
    """A number for people: 4 significant digits (``0.022``, ``1.235e+05``), counts as they are;
    an empty mapping or list is "none", a mapping is ``key: value`` pairs."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {format_value(v)}" for k, v in value.items()) if value else "none"
    if isinstance(value, (list, tuple)):
        return ", ".join(format_value(v) for v in value) if value else "none"
    return str(value)


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _newest_manifest(run: Path) -> dict[str, Any] | None:
    manifests = sorted((run / "checkpoints").glob("step-*/manifest.json"))
    return _json(manifests[-1]) if manifests else None


def _html(run: Path, summary: Any, incidents: list[dict[str, Any]], report: Report) -> str:
    esc = html.escape
    manifest = _newest_manifest(run) or {}
    config = (run / "config.yaml").read_text() if (run / "config.yaml").exists() else "(no config.yaml)"
    facts = {
        "status": (summary or {}).get("status", "unknown (no summary.json)"),
        "reason": (summary or {}).get("reason"),
        "steps": (summary or {}).get("steps"),
        "epochs": (summary or {}).get("epochs"),
        **{k: v for k, v in (summary or {}).items() if k.startswith("val_")},
        "wall_s": (summary or {}).get("wall_s"),
        "incidents": (summary or {}).get("incidents"),
        "torch": manifest.get("torch_version"),
        "torchkeel": manifest.get("torchkeel_version"),
        "git commit": (manifest.get("git_commit") or "not a git repository")
        + (" (dirty)" if manifest.get("git_dirty") else ""),
    }
    rows = "".join(
        f"<tr><th>{esc(k)}</th><td>{esc(format_value(v))}</td></tr>" for k, v in facts.items() if v is not None
    )
    missing = "".join(f"<li>{esc(m)}</li>" for m in report.missing)
    warnings = "".join(f"<li>{esc(w)}</li>" for w in report.warnings)
    images = "".join(
        f'<figure><img src="{esc(p.name)}" width="800" height="300" alt="{esc(p.stem)}"></figure>'
        for p in report.images
    )
    listed = "".join(
        f"<tr><td>{r.get('step')}</td><td>{esc(str(r.get('kind')))}</td><td>{esc(str(r.get('message', '')))}</td></tr>"
        for r in incidents[:200]
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>torchkeel report: {esc(run.name)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:60em}} table{{border-collapse:collapse}}
th,td{{text-align:left;padding:2px 10px;border-bottom:1px solid #ddd;vertical-align:top}}
pre{{background:#f6f6f6;padding:1em;max-height:20em;overflow:auto}} .missing,.warning{{color:#a40}}</style></head>
<body><h1>Run {esc(run.name)}</h1>
<table>{rows}</table>
{f'<h2>Warnings</h2><ul class="warning">{warnings}</ul>' if warnings else ""}
{f'<h2>Missing</h2><ul class="missing">{missing}</ul>' if missing else ""}
<h2>Timeline</h2>{images or '<p class="missing">no charts: nothing was logged yet</p>'}
<h2>Incidents</h2>{f"<table><tr><th>step</th><th>kind</th><th>message</th></tr>{listed}</table>" if listed else "<p>none</p>"}
{_profile_html(run)}<h2>Config</h2><pre>{esc(config)}</pre>
</body></html>
"""


def _profile_html(run: Path) -> str:
    """The ``profile`` section: where the profiled steps' time went, and the top operators."""
    summary = read_summary(run)
    if summary is None:
        return ""
    esc = html.escape
    rows = "".join(
        f"<tr><td>{esc(op['name'])}</td><td>{op['calls']}</td><td>{op['self_ms']:.3f}</td><td>{op['total_ms']:.3f}</td>"
        f"<td>{op.get('device_ms', 0.0):.3f}</td></tr>"
        for op in summary.get("top_ops", [])
    )
    return (
        f"<h2>Profile</h2><p>{esc(describe(summary))}. The trace is in <code>profile/</code> (Perfetto, TensorBoard).</p>"
        "<table><tr><th>operator</th><th>calls (all steps)</th><th>self ms a step</th><th>total ms a step</th>"
        f"<th>device ms a step</th></tr>{rows}</table>\n"
    )
