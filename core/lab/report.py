"""Pictures and the HTML page of a comparison: a timeline (running and waiting requests, batch
tokens, KV-cache usage, preemptions per step, one line per policy), a TTFT CDF per priority class,
and one self-contained page (tables + pictures as base64). Matplotlib with the Agg backend."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from typing import Any, Sequence

from paged.core.errors import PagedError
from paged.core.lab.metrics import format_table, table_rows
from paged.core.lab.records import ReplayResult


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PagedError("the lab's pictures need matplotlib: pip install 'paged[plots]'") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _thin(xs: list[float], ys: list[float], limit: int = 20000) -> tuple[list[float], list[float]]:
    if len(xs) <= limit:
        return xs, ys
    stride = -(-len(xs) // limit)
    return xs[::stride], ys[::stride]


def _series(result: ReplayResult, values: list[float], idle: list[float] | None = None) -> tuple[list[float], list[float]]:
    """Step-function points: each step's value from its start; an idle gap between steps (no
    request left) shows ``idle`` (default 0) from the end of the last step."""
    xs: list[float] = []
    ys: list[float] = []
    prev_end = None
    for k, (step, value) in enumerate(zip(result.steps, values)):
        if prev_end is not None and step.t_start > prev_end + 1e-12:
            xs.append(prev_end)
            ys.append(idle[k] if idle is not None else 0.0)
        xs.append(step.t_start)
        ys.append(value)
        prev_end = step.t_end
    if prev_end is not None:
        xs.append(prev_end)
        ys.append(ys[-1])
    return xs, ys


def _rolling_mean(values: list[float], k: int) -> list[float]:
    sums = [0.0]
    for v in values:
        sums.append(sums[-1] + v)
    return [(sums[j + 1] - sums[max(0, j + 1 - k)]) / min(k, j + 1) for j in range(len(values))]


def plot_timeline(results: Sequence[ReplayResult], path: str | Path, title: str = "") -> Path:
    """Per step: running and waiting requests (after scheduling), batch tokens, KV-cache usage,
    cumulative preemptions; one line per replay; idle gaps at zero."""
    plt = _pyplot()
    names = ["running requests", "waiting requests", "batch tokens", "KV-cache usage (%)", "preemptions (cumulative)"]
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 2.1 * len(names)), sharex=True)
    for result in results:
        steps = result.steps
        if not steps:
            continue
        tokens = [float(s.batch_tokens) for s in steps]
        window = len(steps) // 300 if len(steps) > 600 else 1  # per-step tokens alternate too fast to read
        if window > 1:
            tokens = _rolling_mean(tokens, window)
            axes[2].set_ylabel(f"batch tokens\n(mean of {window} steps)", fontsize=8)
        cumulative, total = [], 0
        for s in steps:
            total += s.preemptions
            cumulative.append(float(total))
        series = [
            _series(result, [float(s.running) for s in steps]),
            _series(result, [float(s.waiting) for s in steps]),
            _series(result, tokens),
            _series(result, [100.0 * s.kv_usage for s in steps]),
            _series(result, cumulative, idle=cumulative),
        ]
        for ax, (xs, ys) in zip(axes, series):
            ax.plot(*_thin(xs, ys), drawstyle="steps-post", label=result.label, linewidth=0.9, alpha=0.85)
    for ax, name in zip(axes, names):
        if not ax.get_ylabel():
            ax.set_ylabel(name, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="upper right")
    mode = results[0].mode if results else ""
    axes[-1].set_xlabel("time (s" + (", simulated" if mode == "sim" else f", {mode} clock") + ")")
    fig.suptitle(title or "scheduling timeline", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_ttft_cdf(results: Sequence[ReplayResult], path: str | Path, title: str = "") -> Path:
    plt = _pyplot()
    classes = sorted({r.priority for res in results for r in res.requests})
    fig, axes = plt.subplots(1, len(classes), figsize=(5.2 * len(classes), 3.6), squeeze=False)
    for ax, c in zip(axes[0], classes):
        spread = []
        for result in results:
            ttfts = sorted(r.ttft for r in result.requests if r.priority == c and r.ttft is not None)
            if not ttfts:
                continue
            spread += [ttfts[0], ttfts[-1]]
            ys = [(k + 1) / len(ttfts) for k in range(len(ttfts))]
            ax.step(ttfts, ys, where="post", label=result.label)
        positive = [v for v in spread if v > 0]
        if positive and max(positive) / min(positive) > 100:
            ax.set_xscale("log")
        ax.set_title(f"priority class {c}", fontsize=9)
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(title or "time to first token, CDF per priority class", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _img(path: Path) -> str:
    data = base64.b64encode(Path(path).read_bytes()).decode()
    return f'<img alt="{html.escape(path.name)}" src="data:image/png;base64,{data}">'


def write_html(path: str | Path, summaries: Sequence[dict[str, Any]], images: Sequence[Path], meta: dict[str, Any]) -> Path:
    header, rows = table_rows(summaries)
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>paged policy lab</title><style>",
        "body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}"
        "table{border-collapse:collapse;font-size:13px}td,th{padding:3px 10px;border-bottom:1px solid #ddd}"
        "td:not(:first-child),th:not(:first-child){text-align:right}tr.section td{font-weight:bold;background:#f3f3f3}"
        "img{max-width:100%;margin:1em 0}pre{background:#f7f7f7;padding:8px;font-size:12px;overflow:auto}",
        "</style></head><body><h1>paged policy lab</h1>",
    ]
    parts.append("<pre>" + html.escape(json.dumps(meta, indent=2, default=str)) + "</pre>")
    parts.append("<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>")
    for row in rows:
        section = row[0].startswith("[")
        cells = "".join(f"<td>{html.escape(c)}</td>" for c in row)
        parts.append(f"<tr class='section'>{cells}</tr>" if section else f"<tr>{cells}</tr>")
    parts.append("</table>")
    for image in images:
        parts.append(_img(Path(image)))
    parts.append("</body></html>\n")
    path = Path(path)
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


def write_report(results: Sequence[ReplayResult], summaries: Sequence[dict[str, Any]], out_dir: str | Path,
                 meta: dict[str, Any], html_page: bool = False) -> dict[str, Path]:
    """timeline.png, ttft_cdf.png, results.json, summary.txt (and report.html) in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    title = f"{meta.get('trace', '')} ({results[0].mode if results else ''})"
    files = {
        "timeline": plot_timeline(results, out / "timeline.png", title=f"timeline: {title}"),
        "ttft_cdf": plot_ttft_cdf(results, out / "ttft_cdf.png", title=f"TTFT CDF: {title}"),
    }
    doc = {"meta": meta, "summaries": list(summaries), "replays": [r.to_dict() for r in results]}
    (out / "results.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    files["results"] = out / "results.json"
    (out / "summary.txt").write_text(format_table(summaries) + "\n")
    files["summary"] = out / "summary.txt"
    if html_page:
        files["html"] = write_html(out / "report.html", summaries, [files["timeline"], files["ttft_cdf"]], meta)
    return files
