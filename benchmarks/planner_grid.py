"""The planner grid: many workloads x clusters x planners, one cost model judging all.

Workloads (`sharding.suites`): the MLPerf DLRM-DCNv2 tables with the power-law profile
`sharding.plan` assumes, the same tables with a profile measured by `sharding.profile`
(from the in-memory synthetic data: Criteo itself cannot be downloaded here; pass your own
with `grid.profile=<profile.json>`), then seeded random suites. Each (workload, cluster)
cell is planned by every planner: `hybrid`, `torchrec` (the fastest under our cost model of
every plan TorchRec's planner rated), `torchrec_own` (the plan TorchRec itself picks),
`greedy_size` and `round_robin`. Cells run in worker processes side by side.
"""

from __future__ import annotations

import csv
import math
import multiprocessing as mp
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from sharding.access_profile import AccessProfile
from sharding.plan_eval import evaluate
from sharding.planners import PLANNERS
from sharding.suites import SuiteSpec, Workload, random_suite
from sharding.types import PlanDoesNotFitError, PlanInputs, PlannerConfig

GRID_PLANNERS = ("hybrid", "torchrec", "torchrec_own", "greedy_size", "round_robin")
TIE = 1e-9  # relative: step times this close are the same


@dataclass
class GridConfig:
    enabled: bool = True
    cells: int = 200  # (workload, cluster) cells: the named workloads first, then random
    clusters: list[str] = field(
        default_factory=lambda: ["1x8_t4_16g", "1x8_a100_80g", "2x8_h100", "hetero_3node"]
    )
    seed: int = 0  # random suites are seeds seed, seed + 1, ...
    workers: int = 2  # processes planning cells side by side
    # TorchRec's own planner timeout per cell (its `timeout_seconds`): it keeps the best
    # plan found by then. Its search over a 1,000-table suite runs for many minutes.
    torchrec_timeout_s: float = 30.0
    profile: str | None = None  # a measured profile.json of the MLPerf tables; None: measure
    profile_batches: int = 50  # when measuring it from the synthetic data
    spec: SuiteSpec = field(default_factory=SuiteSpec)


# Filled by `run_grid` before the worker processes fork: what each cell plans.
_WORKLOADS: list[Workload] = []
_CLUSTERS: dict[str, PlanInputs] = {}
_TIMEOUT: list[float] = [30.0]


def workload_for(inputs: PlanInputs, w: Workload) -> PlanInputs:
    return replace(inputs, tables=w.tables, coverage=w.coverage, dense_params=w.dense_params,
                   interaction_flops_per_sample=w.interaction_flops_per_sample,
                   activation_bytes_per_sample=w.activation_bytes_per_sample)  # fmt: skip


def _plan_cell(index: tuple[int, str]) -> list[dict]:
    """Every planner on one (workload, cluster) cell."""
    from sharding.torchrec_planner import torchrec_plans

    w = _WORKLOADS[index[0]]
    inputs = workload_for(_CLUSTERS[index[1]], w)
    rows = []

    def record(planner: str, plan, seconds: float) -> None:
        rows.append({"suite": w.name, "cluster": index[1], "planner": planner,
                     "est_step_ms": plan.est_step_ms if plan else None,
                     "feasible": bool(plan and plan.feasible), "planning_s": seconds,
                     "tables": len(w.tables), "weights_gb": w.weights_bytes() / 2**30})  # fmt: skip

    for name in ("hybrid", "greedy_size", "round_robin"):
        start = time.perf_counter()
        try:
            plan = evaluate(PLANNERS[name](inputs), inputs, bound=name == "hybrid")
        except PlanDoesNotFitError:
            plan = None
        record(name, plan, time.perf_counter() - start)
        if name == "hybrid" and plan is not None:
            rows[-1]["lower_bound_ms"] = plan.lower_bound_ms
    start = time.perf_counter()
    try:
        tr = torchrec_plans(inputs, PlannerConfig(torchrec_timeout_s=_TIMEOUT[0]))
        best, own = tr.best_ours, tr.chosen
    except PlanDoesNotFitError:
        best = own = None
    seconds = time.perf_counter() - start
    record("torchrec", best, seconds)
    record("torchrec_own", own, seconds)
    return rows


PROFILE_FILE = "profile_mlperf_synthetic.json"


def named_workloads(cfg: GridConfig, mlperf: Workload, out_dir: Path) -> list[Workload]:
    """MLPerf's tables with the parametric profile, then with a measured one."""
    path = Path(cfg.profile) if cfg.profile else out_dir / PROFILE_FILE
    if not path.exists():
        _measure_profile(path, cfg.profile_batches)
    profile = AccessProfile.load(path)
    measured = replace(
        mlperf,
        name="mlperf_dcnv2_profiled",
        tables=[
            replace(t, lookups_per_sample=profile.table(t.name).lookups_per_sample)
            for t in mlperf.tables
        ],  # fmt: skip
        coverage={t.name: profile.table(t.name).hit_rate for t in mlperf.tables},
        source={"profile": str(path), **profile.source},
    )
    return [mlperf, measured]


def _measure_profile(path: Path, batches: int) -> None:
    import subprocess
    import sys
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as run_dir:  # the profile run's own logs
        subprocess.run(
            [sys.executable, "-m", "sharding.profile", "model=dcnv2_mlperf",
             f"batches={batches}", f"output={path.parent}", f"hydra.run.dir={run_dir}"],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
    (path.parent / "profile.json").rename(path)


def run_grid(cfg: GridConfig, clusters: dict[str, PlanInputs], named: list[Workload]) -> dict:
    """Plan every cell; the result holds `cells`, `wins`, `hybrid_losses` and summaries."""
    per_cluster = math.ceil(cfg.cells / len(clusters))
    workloads = list(named[:per_cluster])
    workloads += [random_suite(cfg.seed + i, cfg.spec) for i in range(per_cluster - len(workloads))]
    _WORKLOADS[:] = workloads
    _CLUSTERS.clear()
    _CLUSTERS.update(clusters)
    _TIMEOUT[0] = cfg.torchrec_timeout_s
    jobs = [(i, c) for i in range(len(workloads)) for c in clusters][: cfg.cells]
    rows: list[dict] = []
    start = time.perf_counter()
    context = mp.get_context("fork")  # the workloads above travel by fork, not by pickle
    with context.Pool(cfg.workers, maxtasksperchild=8) as pool:
        for done, cell in enumerate(pool.imap_unordered(_plan_cell, jobs), 1):
            rows += cell
            h = next(r for r in cell if r["planner"] == "hybrid")
            t = next(r for r in cell if r["planner"] == "torchrec")
            ratio = _ratio(t, h)
            print(f"[{done}/{len(jobs)}] {h['cluster']:14} {h['suite']:22} tables {h['tables']:4} "
                  f"hybrid {_ms(h)} torchrec {_ms(t)} "
                  f"({f'{ratio:.2f}x' if ratio else '-'}) {time.perf_counter() - start:.0f} s",
                  flush=True)  # fmt: skip
    order = {(w.name, c): k for k, (w, c) in enumerate((workloads[i], c) for i, c in jobs)}
    rows.sort(key=lambda r: (order[(r["suite"], r["cluster"])], GRID_PLANNERS.index(r["planner"])))
    return summarize(rows) | {"workloads": [{"name": w.name, "tables": len(w.tables),
                                             "weights_gb": w.weights_bytes() / 2**30, **w.source}
                                            for w in workloads]}  # fmt: skip


def _ms(row: dict) -> str:
    return f"{row['est_step_ms']:9.2f}" if row["feasible"] else "      n/a"


def _ratio(other: dict, hybrid: dict) -> float | None:
    """other's step / hybrid's: > 1 when hybrid is faster (None unless both fit)."""
    if other["feasible"] and hybrid["feasible"]:
        return other["est_step_ms"] / hybrid["est_step_ms"]
    return None


def summarize(rows: list[dict]) -> dict:
    """`wins` per planner (fastest feasible plan of a cell, ties to each), the cells where
    another planner beats hybrid (with the fastest such planner), the worst cell against
    TorchRec, and per-cluster figures."""
    cells: dict[tuple[str, str], dict[str, dict]] = {}
    for r in rows:
        cells.setdefault((r["suite"], r["cluster"]), {})[r["planner"]] = r
    wins = {p: 0 for p in GRID_PLANNERS}
    losses, clusters = [], {}
    worst = None
    for (suite, cluster), by in cells.items():
        fits = {p: r["est_step_ms"] for p, r in by.items() if r["feasible"]}
        if fits:
            best = min(fits.values())
            for p, ms in fits.items():
                wins[p] += ms <= best * (1 + TIE)
        h = by["hybrid"]
        others = {p: ms for p, ms in fits.items() if p != "hybrid"}
        if others:
            p = min(others, key=others.get)
            if not h["feasible"] or others[p] < h["est_step_ms"] * (1 - TIE):
                hybrid_ms = h["est_step_ms"] if h["feasible"] else None
                losses.append({"suite": suite, "cluster": cluster, "planner": p,
                               "planner_ms": others[p], "hybrid_ms": hybrid_ms})  # fmt: skip
        c = clusters.setdefault(cluster, {"cells": 0, "speedups": [], "hybrid_feasible": 0,
                                          "torchrec_feasible": 0,
                                          "only_hybrid_fits": 0})  # fmt: skip
        c["cells"] += 1
        c["hybrid_feasible"] += h["feasible"]
        c["torchrec_feasible"] += by["torchrec"]["feasible"]
        c["only_hybrid_fits"] += h["feasible"] and len(fits) == 1
        ratio = _ratio(by["torchrec"], h)
        if ratio is not None:
            c["speedups"].append(ratio)
            if worst is None or ratio < worst["speedup_vs_torchrec"]:
                worst = {"suite": suite, "cluster": cluster, "speedup_vs_torchrec": ratio,
                         "hybrid_ms": h["est_step_ms"],
                         "torchrec_ms": by["torchrec"]["est_step_ms"]}  # fmt: skip
    for c in clusters.values():
        s = c.pop("speedups")
        c["median_speedup_vs_torchrec"] = float(np.median(s)) if s else None
        c["min_speedup_vs_torchrec"] = float(np.min(s)) if s else None
    return {"cells": rows, "wins": wins, "hybrid_losses": losses, "worst_vs_torchrec": worst,
            "clusters": clusters, "cell_count": len(cells)}  # fmt: skip


def write_csv(rows: list[dict], path: Path) -> None:
    keys = ["suite", "cluster", "planner", "est_step_ms", "feasible", "lower_bound_ms",
            "planning_s", "tables", "weights_gb"]  # fmt: skip
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def plot(grid: dict, path: Path) -> None:
    """Per cluster: hybrid's speed-up over TorchRec's best plan in each cell, against the
    suite's table count; cells where TorchRec finds no plan and hybrid does marked at the top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    cells: dict[tuple[str, str], dict[str, dict]] = {}
    for r in grid["cells"]:
        cells.setdefault((r["suite"], r["cluster"]), {})[r["planner"]] = r
    names = list(grid["clusters"])
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.6), sharey=True)
    for ax, cluster in zip(np.atleast_1d(axes), names, strict=True):
        xs, ys, only = [], [], []
        for (_, c), by in cells.items():
            if c != cluster:
                continue
            ratio = _ratio(by["torchrec"], by["hybrid"])
            if ratio is not None:
                xs.append(by["hybrid"]["tables"])
                ys.append(ratio)
            elif by["hybrid"]["feasible"]:
                only.append(by["hybrid"]["tables"])
        ax.scatter(xs, ys, s=14, alpha=0.7, label="both fit")
        top = max(ys, default=2.0) * 1.15
        if only:
            ax.scatter(only, [top] * len(only), marker="^", color="tab:green", s=18,
                       label="TorchRec finds no plan")  # fmt: skip
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FormatStrFormatter("%.1fx"))
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%.1fx"))
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_title(cluster, fontsize=9)
        ax.set_xlabel("tables in the suite")
        ax.grid(True, which="both", alpha=0.3)
    first = np.atleast_1d(axes)[0]
    first.set_ylabel("TorchRec step / hybrid step (predicted)")
    first.legend(fontsize=7, loc="lower left")
    fig.suptitle("Hybrid vs TorchRec's best plan per grid cell (above 1: hybrid faster)",
                 fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(grid: dict) -> list[str]:
    lines = ["", f"## Grid: {grid['cell_count']} cells (workload x cluster), every planner",
             "", "| cluster | cells | hybrid fits | TorchRec fits | only hybrid fits | "
             "median speedup vs TorchRec | min |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, c in grid["clusters"].items():
        med, low = (
            f"{x:.2f}x" if x else "-"
            for x in (c["median_speedup_vs_torchrec"], c["min_speedup_vs_torchrec"])
        )
        lines.append(f"| {name} | {c['cells']} | {c['hybrid_feasible']} | "
                     f"{c['torchrec_feasible']} | {c['only_hybrid_fits']} | {med} | "
                     f"{low} |")  # fmt: skip
    wins = ", ".join(f"{p} {n}" for p, n in grid["wins"].items())
    worst = grid["worst_vs_torchrec"]
    losses = len(grid["hybrid_losses"])
    lines += ["", f"Wins (fastest feasible plan of a cell, ties to each): {wins}.",
              f"Cells where another planner beats hybrid: {losses}."]  # fmt: skip
    if worst:
        lines.append(f"Worst cell against TorchRec: {worst['suite']} on {worst['cluster']}, "
                     f"{worst['speedup_vs_torchrec']:.2f}x ({worst['hybrid_ms']:.2f} ms vs "
                     f"{worst['torchrec_ms']:.2f} ms).")  # fmt: skip
    for loss in grid["hybrid_losses"][:20]:
        hybrid = "no plan" if loss["hybrid_ms"] is None else f"{loss['hybrid_ms']:.2f} ms"
        lines.append(f"- {loss['suite']} on {loss['cluster']}: {loss['planner']} "
                     f"{loss['planner_ms']:.2f} ms vs hybrid {hybrid}")  # fmt: skip
    return lines
