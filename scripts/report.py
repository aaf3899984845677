#!/usr/bin/env python3
"""One self-contained HTML page about a run: where its hours went and how it trained.

    python scripts/report.py RUN_DIR [--out RUN_DIR/report.html] [--png quick.png]

Reads the run directory only (metrics.jsonl, events.jsonl), so it works on a run in progress, on a
directory copied from a pod, and on one on a bucket (RUN_DIR=gs://..., read through fsspec).
The page holds its plots as inline PNG images (matplotlib, Agg): no server, no network, it opens
offline. Plots: loss and eval loss; tokens/s and MFU; the data-wait fraction (and the slowest
host's); goodput and badput as a stacked bar per start of the run; when the held-out loss is
reported by position (data.eval.position_buckets), the loss against the position in the document,
one line per evaluation (the last few). Tables: the goodput
breakdown, the input pipeline's per-stage seconds, bad records, the slowest hosts, a mixture's
source shares. `--png` writes the four plots as one image for a quick look from a terminal
session. Needs the `[report]` extra (matplotlib).
"""
from __future__ import annotations

import argparse
import base64
import html
import io
import sys
import tempfile
import time
from pathlib import Path

from data.readers.objstore import is_url
from data.timing import STAGES
from model.runtime import goodput
from model.runtime.goodput import CAUSES

COLORS = {"productive": "#2ca02c", "startup": "#7f7f7f", "restore": "#9467bd", "data_wait": "#d62728",
          "checkpoint": "#1f77b4", "eval": "#17becf", "stall": "#ff7f0e", "lost": "#8c564b",
          "dead": "#000000", "shutdown": "#bcbd22"}


def load_run(run_dir: str) -> tuple[list[dict], list[dict]]:
    """(metrics rows, events) of a run directory, local or a URL (gs://, s3://: a run directory on
    a bucket, read through fsspec as the training data is, data/readers/objstore.py); a line cut short by
    a run still writing is skipped."""
    if not is_url(run_dir):
        if not Path(run_dir).is_dir():
            raise SystemExit(f"report: {run_dir} is not a directory")
        return _read(Path(run_dir), run_dir)
    from data.readers.objstore import filesystem

    try:
        fs = filesystem(run_dir)
    except ValueError as e:
        raise SystemExit(f"report: {e}") from None
    base = run_dir.rstrip("/")
    if not fs.isdir(base):
        raise SystemExit(f"report: {run_dir} is not a directory")
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("metrics.jsonl", goodput.EVENTS_FILE):     # a log not written yet is absent
            try:
                fs.get(f"{base}/{name}", str(Path(tmp) / name))
            except FileNotFoundError:
                pass
        return _read(Path(tmp), run_dir)


def _read(local: Path, shown: str) -> tuple[list[dict], list[dict]]:
    rows = goodput.read_events(local / "metrics.jsonl")
    events = goodput.read_events(local / goodput.EVENTS_FILE)
    if not rows and not events:
        raise SystemExit(f"report: {shown} holds neither metrics.jsonl nor {goodput.EVENTS_FILE}")
    return rows, events


def _name(run_dir) -> str:
    return str(run_dir).rstrip("/").rsplit("/", 1)[-1]


def series(rows: list[dict], key: str) -> tuple[list, list]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and "step" in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def starts(rows: list[dict]) -> list[list[dict]]:
    """The rows cut where a new start of the run begins (its goodput/restarts count changes) or the
    step goes back (a restart that resumed behind its last row, a rollback): one line is drawn per
    part, so a killed life's end and the next start's first rows are never joined."""
    parts: list[list[dict]] = []
    prev = None
    for r in rows:
        if "step" not in r:
            continue
        if prev is None or r["step"] <= prev["step"] or r.get("goodput/restarts") != prev.get("goodput/restarts"):
            parts.append([])
        parts[-1].append(r)
        prev = r
    return parts


def plot_lines(ax, rows: list[dict], key: str, *, label: str, scale: float = 1.0, **style) -> None:
    """`key` over the steps, one line per start (same style, labelled once)."""
    for part in starts(rows):
        x, y = series(part, key)
        if x:
            ax.plot(x, [v * scale for v in y], label=label, **style)
            label = None


# ---------------------------------------------------------------------- plots (one per axes)
def plot_loss(ax, rows, breakdown):
    plot_lines(ax, rows, "loss", label="train loss", lw=1.2, color="#1f77b4")
    plot_lines(ax, rows, "eval_loss", label="eval loss", marker="o", ms=4, color="#ff7f0e")
    ax.set(title="Loss", xlabel="step")
    ax.legend()


def plot_throughput(ax, rows, breakdown):
    plot_lines(ax, rows, "tokens_per_s", label="tokens/s", color="#1f77b4")
    ax.set(title="Throughput", xlabel="step", ylabel="tokens/s")
    if series(rows, "mfu")[0]:
        ax2 = ax.twinx()
        plot_lines(ax2, rows, "mfu", label="MFU %", scale=100, color="#ff7f0e")
        ax2.set_ylabel("MFU %")
        ax2.legend(loc="lower right")
    ax.legend(loc="upper left")


def plot_data_wait(ax, rows, breakdown):
    plot_lines(ax, rows, "data_wait_frac", label="data wait (slowest host)", color="#d62728")
    ax.set(title="Data-wait fraction of step time", xlabel="step",
           ylim=(0, max([1e-3, *series(rows, "data_wait_frac")[1]]) * 1.1))
    ax.legend()


def plot_goodput(ax, rows, breakdown):
    lives = breakdown["lives"]
    names = [f"start {i + 1}\n({life['reason']})" for i, life in enumerate(lives)]
    bottom = [0.0] * len(lives)
    for part in ("productive",) + CAUSES:
        vals = [life["parts"][part] / 60 for life in lives]
        if any(v > 0 for v in vals):
            ax.bar(names, vals, bottom=bottom, color=COLORS[part], label=part)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set(title=f"Where the time went (goodput {breakdown['goodput']:.1%})", ylabel="minutes")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


POSITION_PREFIX = "eval_loss_pos/"
POSITION_LINES = 6      # evaluations drawn on the loss-by-position plot: the last few


def position_rows(rows: list[dict]) -> list[dict]:
    """The metrics rows holding the held-out loss by position (eval_loss_pos/NN), the last few."""
    return [r for r in rows if any(k.startswith(POSITION_PREFIX) for k in r)][-POSITION_LINES:]


def plot_loss_by_position(ax, rows, breakdown):
    """Held-out loss against the position in the document (the bucket's first position as a
    fraction of seq_len), one line per evaluation step, darker = later."""
    import matplotlib.pyplot as plt

    shown = position_rows(rows)
    cmap = plt.get_cmap("viridis")
    for i, r in enumerate(shown):
        cells = sorted((k[len(POSITION_PREFIX):], v) for k, v in r.items() if k.startswith(POSITION_PREFIX))
        n = max(int(c) for c, _ in cells) + 1
        ax.plot([int(c) / n for c, _ in cells], [v for _, v in cells], marker="o", ms=3,
                color=cmap(i / max(1, len(shown) - 1)), label=f"step {r['step']}")
    ax.set(title="Held-out loss by position in the document", xlabel="position / seq_len", ylabel="loss")
    ax.legend(fontsize=7)


PLOTS = (("loss", plot_loss), ("throughput", plot_throughput), ("data_wait", plot_data_wait),
         ("goodput", plot_goodput))


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return buf.getvalue()


def figures(rows, breakdown) -> dict[str, bytes]:
    import matplotlib.pyplot as plt

    out = {}
    plots = PLOTS + ((("loss_by_position", plot_loss_by_position),) if position_rows(rows) else ())
    for name, draw in plots:
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        draw(ax, rows, breakdown)
        out[name] = _png(fig)
        plt.close(fig)
    return out


def quick_png(rows, breakdown, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 7.5))
    for ax, (_, draw) in zip(axes.flat, PLOTS, strict=True):
        draw(ax, rows, breakdown)
    fig.tight_layout()
    path.write_bytes(_png(fig))
    plt.close(fig)


# ---------------------------------------------------------------------- tables
def table(head: list[str], body: list[list], cls: str = "") -> str:
    def cell(v):
        if isinstance(v, float):
            return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
        return html.escape(str(v))
    out = [f'<table class="{cls}"><tr>' + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"]
    out += ["<tr>" + "".join(f"<td>{cell(v)}</td>" for v in r) + "</tr>" for r in body]
    return "\n".join(out) + "</table>"


def goodput_table(b: dict) -> str:
    wall = b["wall_s"] or 1.0
    body = [[k, b["seconds"][k], b["seconds"][k] / wall] for k in ("productive",) + CAUSES]
    body.append(["wall time (first start to now)", b["wall_s"], 1.0])
    return table(["part", "seconds", "share of wall time"], body)


def lives_table(b: dict) -> str:
    body = []
    for i, life in enumerate(b["lives"]):
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(life["start"]))
        body.append([i + 1, started + " UTC", life["end"] - life["start"], life["start_step"],
                     life["last_step"], life["saved"], life["reason"]])
    return table(["start", "at", "seconds", "from step", "last step", "last saved", "ended"], body)


def input_table(rows: list[dict]) -> str:
    """The input pipeline's per-stage seconds summed over all intervals (every life)."""
    totals = {k: sum(r.get(f"input/{k}_s", 0.0) or 0.0 for r in rows) for k in STAGES}
    if not any(totals.values()):
        return "<p>No per-stage input times in this run's metrics.</p>"
    all_s = sum(totals.values()) or 1.0
    bounds = {}
    for r in rows:
        if r.get("input/bound"):
            bounds[r["input/bound"]] = bounds.get(r["input/bound"], 0) + 1
    body = [[k, totals[k], totals[k] / all_s, bounds.get(k, 0)] for k in STAGES]
    return table(["stage", "seconds", "share", "intervals it bounded"], body)


def latest(rows: list[dict], prefix: str) -> dict:
    """The latest value of every key starting with `prefix` (counters since the last start)."""
    out = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith(prefix):
                out[k[len(prefix):]] = v
    return out


def bad_table(rows) -> str:
    bad = {k: v for k, v in latest(rows, "data/bad_").items() if k != "examples"}
    if not bad:
        return "<p>No bad records counted.</p>"
    return table(["kind", "records (since the last start)"], sorted(bad.items()))


def hosts_table(rows) -> str:
    counts = {}
    for r in rows:
        if "host/slowest_data_wait" in r:
            h = int(r["host/slowest_data_wait"])
            c = counts.setdefault(h, [0, 0.0])
            c[0] += 1
            c[1] += r.get("host/max_data_wait_s", 0.0)
    if not counts:
        return "<p>One host: nothing to compare.</p>"
    body = [[f"process {h}", n, s] for h, (n, s) in sorted(counts.items(), key=lambda kv: -kv[1][0])]
    return table(["host", "intervals it waited longest for data", "its data wait (s)"], body)


def mixture_table(rows) -> str:
    shares = latest(rows, "data/source/")
    names = sorted({k.rsplit("/", 1)[0] for k in shares})
    if not names:
        return ""
    body = [[n, shares.get(f"{n}/token_share", 0.0), shares.get(f"{n}/row_share", 0.0),
             shares.get(f"{n}/tokens", 0), shares.get(f"{n}/epoch", 0)] for n in names]
    return "<h2>Mixture: source shares (since the last start)</h2>" + table(
        ["source", "token share", "row share", "tokens", "epoch"], body)


CSS = """body{font-family:sans-serif;margin:2em;max-width:1400px}img{max-width:100%;border:1px solid #ddd}
.grid{display:grid;grid-template-columns:repeat(auto-fit,minmax(560px,1fr));gap:1em}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}
th{background:#f0f0f0}td:first-child{text-align:left}pre{background:#f6f6f6;padding:.5em}"""
# The page reports whether every plot decoded, body[data-plots] = "N/N", and where each one
# is drawn, body[data-rects] = "x,y,w,h;..." (page pixels): headless browser tests read them.
CHECK_JS = """window.addEventListener('load',function(){var im=document.querySelectorAll('img.plot'),ok=0,r=[];
for(var i=0;i<im.length;i++){if(im[i].complete&&im[i].naturalWidth>0)ok++;var b=im[i].getBoundingClientRect();
r.push([b.left+window.scrollX,b.top+window.scrollY,b.width,b.height].map(Math.round).join(','));}
document.body.setAttribute('data-plots',ok+'/'+im.length);document.body.setAttribute('data-rects',r.join(';'));});"""


def render(run_dir, rows, events, now: float | None = None) -> str:
    b = goodput.breakdown(events, now) if events else goodput.combine([])
    imgs = figures(rows, b)
    plots = "".join(f'<div><img class="plot" alt="{n}" src="data:image/png;base64,'
                    f'{base64.b64encode(png).decode()}"></div>' for n, png in imgs.items())
    last = rows[-1] if rows else {}
    status = "finished" if b["lives"] and b["lives"][-1]["reason"] == "clean" else "in progress or stopped"
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(_name(run_dir))} report</title>
<style>{CSS}</style></head><body>
<h1>Run {html.escape(str(run_dir))}</h1>
<p>Step {last.get('step', '-')}, {status}; {b['restarts'] + 1 if b['lives'] else 0} starts;
goodput <b>{b['goodput']:.1%}</b> of {b['wall_s'] / 3600:.2f} h.</p>
<pre>{html.escape(goodput.summary(b)) if b['lives'] else 'no events.jsonl'}</pre>
<div class="grid">{plots}</div>
<h2>Goodput and badput (all starts)</h2>{goodput_table(b)}
<h2>Starts of the run</h2>{lives_table(b)}
<h2>Input pipeline: seconds per stage (all intervals)</h2>{input_table(rows)}
<h2>Bad records</h2>{bad_table(rows)}
<h2>Where the pod stalled: slowest host per interval</h2>{hosts_table(rows)}
{mixture_table(rows)}
<script>{CHECK_JS}</script></body></html>"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("run_dir", help="a run directory, local or on a bucket (gs://...)")
    p.add_argument("--out", type=Path, help="the HTML file (default RUN_DIR/report.html; for a URL "
                   "./report-<run>.html)")
    p.add_argument("--png", type=Path, help="also write the plots as one PNG")
    args = p.parse_args(argv)
    try:
        import matplotlib
    except ImportError:
        print("report: matplotlib is missing; install the extra: pip install -e '.[report]'", file=sys.stderr)
        return 2
    matplotlib.use("Agg")
    rows, events = load_run(args.run_dir)
    out = args.out or (Path(f"report-{_name(args.run_dir)}.html") if is_url(args.run_dir)
                       else Path(args.run_dir) / "report.html")
    out.write_text(render(args.run_dir, [r for r in rows if "step" in r], events))
    print(f"report: {out}")
    if args.png:
        b = goodput.breakdown(events) if events else goodput.combine([])
        quick_png([r for r in rows if "step" in r], b, args.png)
        print(f"report: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
