"""`elastic-run report LOGDIR -o timeline.png [--html out.html]`: a run's story as a plot.

Why from the events file: it survives etcd and the run, and every agent (and
rank 0's checkpointer) appends to it, so one file tells what happened when.
The figure is drawn from `timeline_data(events)`, a pure function, so tests
check the numbers (world sizes, resize markers) rather than pixels.

Choices written down here:
- Agents sharing a log dir each write their own copy of a round's events;
  round_closed, resize and member_lost are de-duplicated by round (the earliest
  copy wins), checkpoints by step.
- Shaded red ("down"): from a crash (member_lost / worker_exited) to the next
  round_closed, when no worker trained. Shaded orange ("lost work"): from the
  last checkpoint_saved before that crash to the crash, the steps that will be
  trained again. A planned resize (newcomer, spot notice) loses nothing.
- Steps/s comes from the steps and times of consecutive checkpoints in the same
  round (and of `progress` records, if any); with fewer than two the panel is left out.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
from dataclasses import dataclass, field
from pathlib import Path

from elastic_runner.cli.flags import parse_checked
from elastic_runner.errors import ConfigError
from elastic_runner.events import EVENTS_FILE, read_events

CRASH_KINDS = ("member_lost", "worker_exited")
# Causes of an in-process re-formation that are crashes too (down, but no work lost).
IN_PROCESS_LOSSES = ("member-lost", "member-suspected")


@dataclass
class TimelineData:
    """Everything the figure shows, in seconds since the first event."""

    world_times: list[float] = field(default_factory=list)
    world_sizes: list[int] = field(default_factory=list)
    resize_times: list[float] = field(default_factory=list)
    resize_pauses: list[float] = field(default_factory=list)
    resize_labels: list[str] = field(default_factory=list)
    checkpoint_times: list[float] = field(default_factory=list)
    checkpoint_steps: list[int] = field(default_factory=list)
    down_intervals: list[tuple[float, float]] = field(default_factory=list)
    lost_work_intervals: list[tuple[float, float]] = field(default_factory=list)
    rate_times: list[float] = field(default_factory=list)
    steps_per_s: list[float] = field(default_factory=list)
    end: float = 0.0


def _first_per(events: list[dict], kind: str, key: str) -> list[dict]:
    """One event of `kind` per value of `key` (the earliest): agents duplicate them."""
    seen: dict = {}
    for event in events:
        if event.get("kind") == kind and event.get(key) not in seen:
            seen[event.get(key)] = event
    return sorted(seen.values(), key=lambda e: e["time"])


def timeline_data(events: list[dict]) -> TimelineData:
    """Turn a time-ordered event list (events.read_events) into plot data."""
    data = TimelineData()
    if not events:
        return data
    t0 = events[0]["time"]
    data.end = events[-1]["time"] - t0
    for event in _first_per(events, "round_closed", "round"):
        data.world_times.append(event["time"] - t0)
        data.world_sizes.append(int(event.get("world_size", 0)))
    for event in _first_per(events, "resize", "round"):
        data.resize_times.append(event["time"] - t0)
        data.resize_pauses.append(float(event.get("pause_s", 0.0)))
        data.resize_labels.append(f"{event.get('old_world_size')}→{event.get('new_world_size')}"
                                  f" {float(event.get('pause_s', 0.0)):.1f}s")
    saves = _first_per(events, "checkpoint_saved", "step")
    data.checkpoint_times = [e["time"] - t0 for e in saves]
    data.checkpoint_steps = [int(e["step"]) for e in saves]
    _lost_intervals(events, saves, t0, data)
    _rates(events, saves, t0, data)
    return data


def _lost_intervals(events: list[dict], saves: list[dict], t0: float,
                    data: TimelineData) -> None:
    closes = [e["time"] for e in _first_per(events, "round_closed", "round")]
    crashes = [e for kind in CRASH_KINDS for e in _first_per(events, kind, "round")]
    crashes += [e for e in _first_per(events, "reform_started", "round")
                if str(e.get("reason", "")).startswith(IN_PROCESS_LOSSES)]
    for crash in sorted(crashes, key=lambda e: e["time"]):
        at = crash["time"]
        if any(start <= at - t0 <= end for start, end in data.down_intervals):
            continue  # one outage, reported by several agents or kinds
        after = next((t for t in closes if t > at), events[-1]["time"])
        data.down_intervals.append((at - t0, after - t0))
        if crash["kind"] == "reform_started":
            continue  # workers kept their state: at most the step in flight is lost
        before = [s["time"] for s in saves if s["time"] <= at]
        if before:
            data.lost_work_intervals.append((before[-1] - t0, at - t0))


def _rates(events: list[dict], saves: list[dict], t0: float, data: TimelineData) -> None:
    points = sorted(saves + [e for e in events if e.get("kind") == "progress"],
                    key=lambda e: e["time"])
    for prev, cur in zip(points, points[1:]):
        span = cur["time"] - prev["time"]
        gained = int(cur.get("step", 0)) - int(prev.get("step", 0))
        if span > 0 and gained > 0 and cur.get("round") == prev.get("round"):
            data.rate_times.append(cur["time"] - t0)
            data.steps_per_s.append(gained / span)


# ---- drawing --------------------------------------------------------------------
def draw(data: TimelineData, title: str = "elastic-run timeline"):
    """A matplotlib Figure of the timeline (Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    panels = 2 if data.steps_per_s else 1
    figure = Figure(figsize=(11, 4 + 2.5 * (panels - 1)), dpi=120)
    axes = figure.subplots(panels, 1, sharex=True, squeeze=False)[:, 0]
    world = axes[0]
    _draw_world(world, data)
    world.set_title(title)
    if panels == 2:
        axes[1].plot(data.rate_times, data.steps_per_s, marker="o", color="tab:green")
        axes[1].set_ylabel("steps/s")
        axes[1].set_ylim(bottom=0)
        axes[1].grid(alpha=0.3)
    axes[-1].set_xlabel("seconds since the first event")
    figure.tight_layout()
    return figure


def _draw_world(ax, data: TimelineData) -> None:
    times = data.world_times + [max(data.end, data.world_times[-1] if data.world_times else 0)]
    sizes = data.world_sizes + data.world_sizes[-1:]
    if data.world_sizes:
        ax.step(times, sizes, where="post", color="tab:blue", linewidth=2, label="world size")
    for i, (start, end) in enumerate(data.down_intervals):
        ax.axvspan(start, end, color="tab:red", alpha=0.2, label="down" if i == 0 else None)
    for i, (start, end) in enumerate(data.lost_work_intervals):
        ax.axvspan(start, end, color="tab:orange", alpha=0.2,
                   label="lost work" if i == 0 else None)
    top = max(sizes, default=1) + 1
    for t, label in zip(data.resize_times, data.resize_labels):
        ax.axvline(t, color="tab:purple", linestyle="--", linewidth=1)
        ax.text(t, top - 0.3, label, rotation=90, va="top", ha="right", fontsize=8)
    if data.checkpoint_times:
        ax.scatter(data.checkpoint_times, [0.3] * len(data.checkpoint_times), marker="v",
                   color="tab:gray", label="checkpoint", zorder=3)
    from matplotlib.ticker import MaxNLocator

    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(0, top)
    ax.set_ylabel("world size")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)


def png_bytes(data: TimelineData, title: str) -> bytes:
    buffer = io.BytesIO()
    draw(data, title).savefig(buffer, format="png")
    return buffer.getvalue()


def html_page(png: bytes, events: list[dict], title: str) -> str:
    """One self-contained page: the plot inline (base64) and every event as a row."""
    t0 = events[0]["time"] if events else 0.0
    skip = {"time", "run_id", "node", "kind"}
    rows = "\n".join(
        "<tr><td>{:.2f}</td><td>{}</td><td>{}</td><td>{}</td></tr>".format(
            e.get("time", t0) - t0, html.escape(str(e.get("node"))),
            html.escape(str(e.get("kind"))),
            html.escape(", ".join(f"{k}={v}" for k, v in sorted(e.items()) if k not in skip)))
        for e in events)
    image = base64.b64encode(png).decode()
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
            "</title><style>body{font-family:sans-serif}td,th{padding:2px 8px;"
            "border-bottom:1px solid #ddd;font-size:13px}</style></head><body>"
            f"<h1>{html.escape(title)}</h1><img alt='timeline' "
            f"src='data:image/png;base64,{image}'><table><tr><th>t (s)</th><th>node</th>"
            f"<th>kind</th><th>detail</th></tr>\n{rows}\n</table></body></html>\n")


def events_path(logdir: str) -> Path:
    path = Path(logdir)
    found = path / EVENTS_FILE if path.is_dir() else path
    if not found.is_file():
        raise ConfigError(f"no events file at {found}: pass the --log-dir the agents used "
                          "(or an events.jsonl)")
    return found


def main(argv: list[str], environ: dict[str, str]) -> int:
    parser = argparse.ArgumentParser(prog="elastic-run report",
                                     description="Plot a run's timeline from its events file.")
    parser.add_argument("logdir", help="the agents' --log-dir (or its events.jsonl)")
    parser.add_argument("-o", "--output", default="timeline.png", help="PNG to write")
    parser.add_argument("--html", help="also write a self-contained HTML page here")
    args = parse_checked(parser, argv)
    events = read_events(events_path(args.logdir))
    if not events:
        raise ConfigError(f"{args.logdir}: the events file is empty; nothing to plot")
    run_ids = sorted({str(e.get("run_id")) for e in events})
    title = f"run {', '.join(run_ids)}"
    png = png_bytes(timeline_data(events), title)
    Path(args.output).write_bytes(png)
    if args.html:
        Path(args.html).write_text(html_page(png, events, title))
    print(f"wrote {args.output}" + (f" and {args.html}" if args.html else ""))
    return 0
