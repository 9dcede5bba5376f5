"""`python -m benchmarks.trace_view <run dir> [<run dir> ...] --out <png>`: the
`trainer.profile_steps` traces of runs side by side, rank by rank: what each rank's main
thread computes and when gloo's threads move data, and how much of the exchange ran under
compute.

Per rank two lanes: the main thread's ATen ops (matmuls apart from the rest) and the
collectives gloo runs on its own threads (`gloo:all_to_all`, `gloo:all_reduce`; their
spans are the data moving). `overlap` is the share of the all-to-all time during which the
main thread was inside an ATen op: 0 when the step waits for every exchange (the plain
loop), higher as a pipeline hides it. Also printed as a table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MATMUL = ("aten::addmm", "aten::mm", "aten::bmm", "aten::matmul", "aten::linear")


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _measure(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in _union(spans))


def _intersection(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    total, ys = 0.0, _union(ys)
    for a, b in _union(xs):
        for c, d in ys:
            total += max(0.0, min(b, d) - max(a, c))
    return total


def read_trace(path: Path) -> dict:
    """A rank's trace as lanes of (start, end) spans in ms from the first event."""
    events = [
        e
        for e in json.loads(path.read_text())["traceEvents"]
        if e.get("ph") == "X" and isinstance(e.get("tid"), int)
    ]
    if not events:
        raise ValueError(f"'{path}' holds no timed events")
    t0 = min(e["ts"] for e in events)
    main = max({e["tid"] for e in events}, key=lambda t: sum(e["tid"] == t for e in events))

    def span(e: dict) -> tuple[float, float]:
        return ((e["ts"] - t0) / 1e3, (e["ts"] + e.get("dur", 0) - t0) / 1e3)

    aten = [e for e in events if e["tid"] == main and e["name"].startswith("aten::")]
    lanes = {
        "matmul": [span(e) for e in aten if e["name"] in MATMUL],
        "other ops": [span(e) for e in aten if e["name"] not in MATMUL],
        "all_to_all": [span(e) for e in events if e["name"] == "gloo:all_to_all"],
        "all_reduce": [span(e) for e in events if e["name"] == "gloo:all_reduce"],
    }
    a2a = _measure(lanes["all_to_all"])
    compute = lanes["matmul"] + lanes["other ops"]
    return {
        "lanes": lanes,
        "span_ms": max(b for spans in lanes.values() for _, b in spans) if a2a or compute else 0,
        "all_to_all_ms": a2a,
        "overlap": _intersection(lanes["all_to_all"], compute) / a2a if a2a else None,
    }


def draw(runs: dict[str, list[dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "matmul": "tab:blue",
        "other ops": "tab:gray",
        "all_to_all": "tab:orange",
        "all_reduce": "tab:green",
    }
    rows = [(label, r, t) for label, ranks in runs.items() for r, t in enumerate(ranks)]
    fig, axes = plt.subplots(len(rows), 1, figsize=(11, 1.3 * len(rows) + 0.6), squeeze=False)
    width = max(t["span_ms"] for _, _, t in rows)
    for ax, (label, rank, t) in zip(axes[:, 0], rows, strict=True):
        for y, lanes in ((1, ("matmul", "other ops")), (0, ("all_to_all", "all_reduce"))):
            for lane in lanes:
                spans = _union(t["lanes"][lane])
                ax.broken_barh(
                    [(a, b - a) for a, b in spans], (y - 0.4, 0.8), color=colors[lane], label=lane
                )
        ax.set_yticks([1, 0], ["main thread", "gloo"], fontsize=8)
        ax.set_xlim(0, width)
        share = "" if t["overlap"] is None else f", {t['overlap']:.0%} of it under compute"
        ax.set_title(
            f"{label}, rank {rank}: all-to-all {t['all_to_all_ms']:.1f} ms{share}",
            fontsize=9,
            loc="left",
        )
    axes[-1, 0].set_xlabel("ms since the first traced event")
    handles = {h.get_label(): h for ax in axes[:, 0] for h in ax.get_legend_handles_labels()[0]}
    fig.legend(handles.values(), handles.keys(), loc="upper right", ncol=4, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.trace_view", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("runs", nargs="+", help="run directories with traces/rank<r>.json")
    parser.add_argument("--labels", nargs="*", help="one per run (default: directory names)")
    parser.add_argument("--out", default="trace.png", help="the picture to write")
    args = parser.parse_args(argv)
    labels = args.labels or [Path(r).name for r in args.runs]
    if len(labels) != len(args.runs):
        parser.error(f"{len(args.runs)} runs but {len(labels)} labels")
    runs = {}
    for label, run in zip(labels, args.runs, strict=True):
        files = sorted(Path(run, "traces").glob("rank*.json"), key=lambda p: int(p.stem[4:]))
        if not files:
            parser.error(
                f"'{run}' has no traces/rank<r>.json: train with trainer.profile_steps=[first,last]"
            )
        runs[label] = [read_trace(f) for f in files]
    print("| run | rank | all-to-all ms | under compute |\n|---|---|---|---|")
    for label, ranks in runs.items():
        for r, t in enumerate(ranks):
            share = "-" if t["overlap"] is None else f"{t['overlap']:.0%}"
            print(f"| {label} | {r} | {t['all_to_all_ms']:.1f} | {share} |")
    draw(runs, Path(args.out))
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
