"""Pictures of benchmark results, drawn from the JSON the benchmark saved.

Each benchmark calls its function when it finishes; `python -m benchmarks.plots DIR ...`
redraws them from saved results (`benchmarks/results/<name>/`), so a picture always shows
exactly the numbers beside it.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _where(result: dict) -> str:
    env = result.get("environment", {})
    return f"{env.get('date', '')[:10]}, torch {env.get('torch', '?')}, {env.get('cpus', '?')} CPUs"


def pipelines(result: dict, path: Path) -> None:
    """Samples/s over TorchRec's SparseDist and exposed communication, per pipeline; bars of
    pipelines whose losses equal the plain loop's are solid, the others hatched."""
    plt = _plt()
    rows = result["rows"]
    names = [r["pipeline"] for r in rows]
    exact = [bool(r["equal_to_plain"]) for r in rows]
    first = rows[0]["samples_per_s"]
    versus = "TorchRec SparseDist" if "sparse_dist" in names else names[0]
    speed = [r["samples_per_s"] / first for r in rows]
    if "sparse_dist" in names:
        speed = [result["speedup_vs_sparse_dist"][n] for n in names]
    exposed = [r["exposed_comm_ms"] or 0.0 for r in rows]  # 0: no fast-link runs
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 0.35 * len(rows) + 1.8), sharey=True)
    y = list(range(len(rows)))[::-1]
    panels = (
        (a, speed, "tab:green", f"samples/s over {versus}"),
        (b, exposed, "tab:orange", "exposed communication, ms/step"),
    )
    for ax, values, color, label in panels:
        bars = ax.barh(y, values, color=color)
        for bar, ok in zip(bars, exact, strict=True):
            if not ok:
                bar.set_hatch("//")
                bar.set_alpha(0.6)
        for v, yy in zip(values, y, strict=True):
            ax.annotate(
                f"{v:.2f}",
                (v, yy),
                xytext=(3, 0),
                textcoords="offset points",
                va="center",
                fontsize=7,
            )
        ax.set_xlabel(label)
        ax.grid(axis="x", alpha=0.3)
    a.axvline(1.0, color="k", lw=0.8)
    a.set_yticks(y, names, fontsize=8)
    link = result.get("link") or {}
    where = f"a {link['rate_mbit']:.0f} Mbit/s link" if link.get("rate_mbit") else "its link"
    cluster = (result.get("config") or {}).get("cluster") or {}
    if cluster.get("name"):
        where = f"the emulated cluster {cluster['name']} ({where.removeprefix('a ')} between nodes)"
    fig.suptitle(
        f"Train pipelines on {where} ({_where(result)}); hatched: not bit for bit the plain loop",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _predicted_and_measured(
    path: Path,
    labels: list[str],
    predicted: list[float],
    measured: list[float],
    measured_label: str,
    title: str,
    above: list[str] | None = None,
    label_size: int = 10,
) -> None:
    """One pair of bars per label, the cost model's step beside the trained one (`above`:
    a note over each measured bar)."""
    plt = _plt()
    x = range(len(labels))
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(labels)), 4))
    ax.bar(
        [i - 0.2 for i in x], predicted, 0.4, label="predicted by the cost model", color="tab:gray"
    )
    ax.bar([i + 0.2 for i in x], measured, 0.4, label=measured_label, color="tab:blue")
    for i, note in enumerate(above or []):
        ax.annotate(
            note,
            (i + 0.2, measured[i]),
            xytext=(0, 2),
            textcoords="offset points",
            ha="center",
            fontsize=7,
        )
    ax.set_xticks(list(x), labels, fontsize=label_size)
    ax.set_ylabel("ms per step")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plan_train(result: dict, path: Path) -> None:
    """Per planner, the predicted and the measured step time of its plan, trained."""
    rows = result["rows"]
    names = [r["planner"] for r in rows]
    _predicted_and_measured(
        path,
        names,
        [r["predicted_step_ms"] for r in rows],
        [r["measured_step_ms"] for r in rows],
        "measured, trained",
        f"Each planner's plan trained: step time, and speed over {names[0]} (above the bars)"
        f"\n{_where(result)}",
        above=[f"{r['speedup_vs_first']:.2f}x" for r in rows],
    )


def _runs(batch: list[int]) -> str:
    """A batch split for a label: equal neighbours as one count, `2731x2/1365x2`."""
    groups = [(v, len(list(g))) for v, g in itertools.groupby(batch)]
    return "/".join(f"{v}x{n}" if n > 1 else str(v) for v, n in groups)


def batch_split(result: dict, path: Path) -> None:
    """Per batch split of hybrid's plan (and the baseline's plan), the predicted and the
    measured step time: does the split the cost model prices fastest train fastest?"""
    rows = result["rows"]
    _predicted_and_measured(
        path,
        [f"{r['split']}\n{_runs(r['batch_per_rank'])}" for r in rows],
        [r["predicted_ms"] for r in rows],
        [r["measured_ms"] for r in rows],
        "measured, trained (median)",
        f"Hybrid's plan at several batch splits on {result['config']['cluster']['name']}\n"
        f"fastest measured {result['best_measured']}, fastest predicted "
        f"{result['best_predicted']}; {_where(result)}",
        label_size=7,
    )


def planner_gains(result: dict, path: Path) -> None:
    """Per preset cluster, predicted step time from TorchRec's plan through each of hybrid's
    ideas added in turn (the gain decomposition), with the lower bound."""
    plt = _plt()
    presets = {k: v for k, v in result["presets"].items() if v.get("decomposition")}
    cols = min(2, len(presets))
    rows = -(-len(presets) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4 * rows), squeeze=False)
    for ax in axes.flat[len(presets) :]:
        ax.set_visible(False)
    for ax, (name, p) in zip(axes.flat, presets.items(), strict=False):
        steps = p["decomposition"]
        ax.bar(
            range(len(steps)),
            [s["ms"] for s in steps],
            color=["tab:gray" if s["step"].startswith("torchrec") else "tab:blue" for s in steps],
        )
        ax.axhline(p["lower_bound_ms"], color="k", ls="--", lw=1, label="lower bound")
        ax.set_xticks(
            range(len(steps)), [s["step"] for s in steps], rotation=35, ha="right", fontsize=7
        )
        ax.set_ylabel("predicted ms per step")
        ax.set_title(f"{name}: TorchRec (grey) to hybrid (blue)", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(
        f"Where hybrid's gain comes from, ideas added in turn ({_where(result)})", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def redraw(directory: Path) -> list[Path]:
    """Draw the pictures a saved results directory supports; returns what was written."""
    summary = directory / "summary.json"
    if not summary.exists():
        return []
    result = json.loads(summary.read_text())
    drawn = []
    for key, draw, name in (
        ("speedup_vs_sparse_dist", pipelines, "pipelines.png"),
        ("best_predicted", batch_split, "batch_split.png"),
        ("rows", plan_train, "plan_train.png"),
        ("presets", planner_gains, "planner_gains.png"),
    ):
        if key in result and (key != "rows" or "planner" in (result["rows"] or [{}])[0]):
            draw(result, directory / name)
            drawn.append(directory / name)
            break
    return drawn


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m benchmarks.plots RESULTS_DIR ... (each with a summary.json)")
        return 2
    for d in argv:
        drawn = redraw(Path(d))
        print(f"{d}: " + (", ".join(map(str, drawn)) or "no summary.json a picture is made of"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
