"""The planner grid: many workloads x clusters x planners, one cost model judging all.

Workloads (`sharding.suites`): the MLPerf DLRM-DCNv2 tables with the power-law profile
`sharding.plan` assumes, the same tables with a profile measured by `sharding.profile`
(from the in-memory synthetic data: Criteo itself cannot be downloaded here; pass your own
with `grid.profile=<profile.json>`), the same tables with MLPerf's multi-hot bags, then
seeded random suites (pooling factors 1 to 100: multi-hot). Clusters: the presets named in
`grid.clusters` and `grid.layouts` layouts generated from seeds (`sharding.layouts`). Each
(workload, cluster) cell is planned by every planner: `hybrid`, `torchrec` (the fastest
under our cost model of every plan TorchRec's planner rated), `torchrec_own` (the plan
TorchRec itself picks), `greedy_size` and `round_robin`, all told the same memory
(`sharding.memory`) and the same narrowest column piece; TorchRec searches for at least as
long as hybrid took on the cell (`torchrec_timeout_s` at least) and each cell records
whether its search was cut. Cells run in worker processes side by side, each written to
`grid_cells.jsonl` as it finishes: run again with the same output directory and settings,
the grid goes on from the cells it has.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import multiprocessing as mp
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from sharding.access_profile import AccessProfile
from sharding.errors import UserError
from sharding.plan_eval import evaluate
from sharding.planners import PLANNERS
from sharding.suites import SuiteSpec, Workload, random_suite
from sharding.types import PlanDoesNotFitError, PlanInputs, PlannerConfig

GRID_PLANNERS = ("hybrid", "torchrec", "torchrec_own", "greedy_size", "round_robin")
TIE = 0.005  # relative: step times within 0.5% of each other are ties
SLOW_LINK_GBIT_S = 25.0  # a mixed cluster's nodes joined at or below this: `slow_mixed`
CELLS_FILE = "grid_cells.jsonl"


@dataclass
class GridConfig:
    enabled: bool = True
    cells: int = 400  # (workload, cluster) cells: the named workloads first, then random
    clusters: list[str] = field(
        default_factory=lambda: [
            "1x1_a100_80g",
            "1x8_t4_16g",
            "1x8_a100_80g",
            "2x8_h100",
            "hetero_3node",
        ]
    )
    seed: int = 0  # random suites are seeds seed, seed + 1, ...
    workers: int = 2  # processes planning cells side by side
    # TorchRec's own planner timeout per cell (its `timeout_seconds`), at least: it also
    # gets as long as hybrid took on the cell; it keeps the best plan found by then
    torchrec_timeout_s: float = 30.0
    layouts: int = 11  # layouts generated from seeds layout_seed, layout_seed + 1, ...
    layout_seed: int = 1000
    layout_max_ranks: int = 512
    profile: str | None = None  # a measured profile.json of the MLPerf tables; None: measure
    profile_batches: int = 50  # when measuring it from the synthetic data
    spec: SuiteSpec = field(default_factory=SuiteSpec)
    # plan only the cells of the `slow_mixed` clusters (the same cells the whole grid has)
    only_slow_mixed: bool = False


# Filled by `run_grid` before the worker processes fork: what each cell plans.
_WORKLOADS: list[Workload] = []
_CLUSTERS: dict[str, PlanInputs] = {}
_TIMEOUT: list[float] = [30.0]


def slow_mixed(inputs: PlanInputs) -> bool:
    """Devices of more than one kind on more than one node, the nodes joined at or below
    `SLOW_LINK_GBIT_S`: where the dense reduction and the exchange cross a slow link."""
    ranks = inputs.ranks
    return (
        len({r.kind for r in ranks}) > 1
        and len({r.node for r in ranks}) > 1
        and inputs.network.alltoall.bytes_per_s * 8 / 1e9 <= SLOW_LINK_GBIT_S
    )


def workload_for(inputs: PlanInputs, w: Workload) -> PlanInputs:
    return replace(
        inputs,
        tables=w.tables,
        coverage=w.coverage,
        dense_params=w.dense_params,
        interaction_flops_per_sample=w.interaction_flops_per_sample,
        activation_bytes_per_sample=w.activation_bytes_per_sample,
    )


def _plan_cell(index: tuple[int, str]) -> list[dict]:
    """Every planner on one (workload, cluster) cell."""
    from sharding.torchrec_planner import torchrec_plans

    w = _WORKLOADS[index[0]]
    inputs = workload_for(_CLUSTERS[index[1]], w)
    rows = []
    hybrid_s = 0.0

    def record(planner: str, plan, seconds: float) -> None:
        rows.append(
            {
                "suite": w.name,
                "cluster": index[1],
                "planner": planner,
                "est_step_ms": plan.est_step_ms if plan else None,
                "feasible": bool(plan and plan.feasible),
                "planning_s": seconds,
                "tables": len(w.tables),
                "weights_gb": w.weights_bytes() / 2**30,
            }
        )

    for name in ("hybrid", "greedy_size", "round_robin"):
        start = time.perf_counter()
        try:
            plan = evaluate(PLANNERS[name](inputs), inputs, bound=name == "hybrid")
        except PlanDoesNotFitError:
            plan = None
        record(name, plan, time.perf_counter() - start)
        if name == "hybrid":
            hybrid_s = rows[-1]["planning_s"]
            if plan is not None:
                rows[-1]["lower_bound_ms"] = plan.lower_bound_ms
                rows[-1]["gap_to_bound"] = plan.est_step_ms / plan.lower_bound_ms
    timeout = max(_TIMEOUT[0], hybrid_s)  # at least as long a search as hybrid's
    start = time.perf_counter()
    try:
        tr = torchrec_plans(inputs, PlannerConfig(torchrec_timeout_s=timeout))
        best, own, search_s = tr.best_ours, tr.chosen, tr.result.planning_s
    except PlanDoesNotFitError:
        best = own = None
        search_s = time.perf_counter() - start
    seconds = time.perf_counter() - start  # its search, and pricing every plan it rated
    for name, plan in (("torchrec", best), ("torchrec_own", own)):
        record(name, plan, seconds)
        rows[-1]["search_s"] = search_s
        rows[-1]["search_limit_s"] = timeout
        rows[-1]["search_cut"] = search_s >= timeout  # TorchRec stopped at its timeout
    return rows


PROFILE_FILE = "profile_mlperf_synthetic.json"


def named_workloads(cfg: GridConfig, mlperf: Workload, out_dir: Path) -> list[Workload]:
    """MLPerf's tables with the parametric profile, with a measured one, and with MLPerf's
    multi-hot bags (`dataset.hotness=mlperf`: 1 to 100 ids a bag)."""
    from recsys.data.multi_hot import MLPERF_HOTNESS

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
        ],
        coverage={t.name: profile.table(t.name).hit_rate for t in mlperf.tables},
        source={"profile": str(path), **profile.source},
    )
    multi_hot = replace(
        mlperf,
        name="mlperf_dcnv2_multihot",
        tables=[
            replace(t, lookups_per_sample=float(h))
            for t, h in zip(mlperf.tables, MLPERF_HOTNESS, strict=True)
        ],
        source={**mlperf.source, "hotness": "mlperf"},
    )
    return [mlperf, measured, multi_hot]


def _measure_profile(path: Path, batches: int) -> None:
    import subprocess
    import sys
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as run_dir:  # the profile run's own logs
        subprocess.run(
            [
                sys.executable,
                "-m",
                "sharding.profile",
                "model=dcnv2_mlperf",
                f"batches={batches}",
                f"output={path.parent}",
                f"hydra.run.dir={run_dir}",
            ],
            check=True,
            capture_output=True,
            text=True,
        )
    (path.parent / "profile.json").rename(path)


def grid_fingerprint(
    cfg: GridConfig, clusters: dict[str, PlanInputs], workloads: list[Workload]
) -> dict:
    """What a grid's cells depend on: a cells file made under another is refused."""
    return {
        "cells": cfg.cells,
        "clusters": {c: _digest(i) for c, i in clusters.items()},
        "seed": cfg.seed,
        "workloads": [w.name for w in workloads],
        "spec": repr(cfg.spec),
        "torchrec_timeout_s": cfg.torchrec_timeout_s,
        **({"only_slow_mixed": True} if cfg.only_slow_mixed else {}),
    }


def _digest(inputs: PlanInputs) -> str:
    """What a cluster's cells depend on besides the workload: its ranks, links, batch,
    precision and schedule (a preset or layout changed under the same name is another grid)."""
    what = (
        inputs.ranks,
        inputs.network,
        inputs.devices,
        inputs.global_batch,
        inputs.precision,
        inputs.schedule,
        inputs.micro_batches,
        inputs.reserve,
    )
    return hashlib.sha1(repr(what).encode()).hexdigest()[:16]


def _resume(path: Path, fingerprint: dict) -> list[dict]:
    """The rows of the cells a stopped run of the same grid wrote (none if no file); a file
    of another grid is refused, naming the setting that differs."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"grid": fingerprint}) + "\n")
        return []
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])["grid"] if lines else {}
    if header != fingerprint:
        differ = sorted(k for k in fingerprint if header.get(k) != fingerprint[k])
        raise UserError(
            f"{path} holds the cells of another grid (differs in: {', '.join(differ)}); give "
            f"another output directory, or delete the file to start this grid afresh"
        )
    rows = []
    for line in lines[1:]:
        try:
            rows += json.loads(line)
        except json.JSONDecodeError:  # the last line of a run stopped mid-write
            break
    return rows


def grid_workloads(cfg: GridConfig, named: list[Workload], clusters: int) -> list[Workload]:
    """The grid's workloads: the named ones, then random suites seed, seed + 1, ..., enough
    for `cfg.cells` cells over `clusters` clusters."""
    per_cluster = math.ceil(cfg.cells / clusters)
    workloads = list(named[:per_cluster])
    return workloads + [
        random_suite(cfg.seed + i, cfg.spec) for i in range(per_cluster - len(workloads))
    ]


def run_grid(
    cfg: GridConfig, clusters: dict[str, PlanInputs], named: list[Workload], out_dir: Path
) -> dict:
    """Plan every cell, each written to `out_dir`/grid_cells.jsonl as it finishes (cells
    already there are kept, not planned again); the result holds `cells`, `wins`,
    `hybrid_losses` and summaries."""
    workloads = grid_workloads(cfg, named, len(clusters))
    _WORKLOADS[:] = workloads
    _CLUSTERS.clear()
    _CLUSTERS.update(clusters)
    _TIMEOUT[0] = cfg.torchrec_timeout_s
    jobs = [(i, c) for i in range(len(workloads)) for c in clusters][: cfg.cells]
    slow = sorted(c for c, inputs in clusters.items() if slow_mixed(inputs))
    if cfg.only_slow_mixed:
        jobs = [j for j in jobs if j[1] in slow]
    cells_file = out_dir / CELLS_FILE
    rows = _resume(cells_file, grid_fingerprint(cfg, clusters, workloads))
    have = {(r["suite"], r["cluster"]) for r in rows}
    todo = [j for j in jobs if (workloads[j[0]].name, j[1]) not in have]
    if have:
        print(f"{len(jobs) - len(todo)} of {len(jobs)} cells from {cells_file}", flush=True)
    start = time.perf_counter()
    context = mp.get_context("fork")  # the workloads above travel by fork, not by pickle
    with context.Pool(cfg.workers, maxtasksperchild=8) as pool, cells_file.open("a") as out:
        for done, cell in enumerate(pool.imap_unordered(_plan_cell, todo), 1):
            out.write(json.dumps(cell) + "\n")
            out.flush()
            rows += cell
            h = next(r for r in cell if r["planner"] == "hybrid")
            t = next(r for r in cell if r["planner"] == "torchrec")
            ratio = _ratio(t, h)
            print(
                f"[{done}/{len(todo)}] {h['cluster']:14} {h['suite']:22} tables {h['tables']:4} "
                f"hybrid {_ms(h)} torchrec {_ms(t)} "
                f"({f'{ratio:.2f}x' if ratio else '-'}) {time.perf_counter() - start:.0f} s",
                flush=True,
            )
    elapsed = time.perf_counter() - start
    order = {(w.name, c): k for k, (w, c) in enumerate((workloads[i], c) for i, c in jobs)}
    rows.sort(key=lambda r: (order[(r["suite"], r["cluster"])], GRID_PLANNERS.index(r["planner"])))
    return summarize(rows, slow) | {
        "workloads": [
            {
                "name": w.name,
                "tables": len(w.tables),
                "weights_gb": w.weights_bytes() / 2**30,
                **w.source,
            }
            for w in workloads
        ],
        # this run's wall time and the cells an earlier, stopped run had planned; a whole
        # grid's wall time is about `cell_seconds` / `workers`
        "elapsed_s": elapsed,
        "cells_resumed": len(jobs) - len(todo),
        "workers": cfg.workers,
    }


def _ms(row: dict) -> str:
    return f"{row['est_step_ms']:9.2f}" if row["feasible"] else "      n/a"


def _ratio(other: dict, hybrid: dict) -> float | None:
    """other's step / hybrid's: > 1 when hybrid is faster (None unless both fit)."""
    if other["feasible"] and hybrid["feasible"]:
        return other["est_step_ms"] / hybrid["est_step_ms"]
    return None


def summarize(rows: list[dict], slow: Sequence[str] = ()) -> dict:
    """`wins` per planner (fastest feasible plan of a cell, ties to each), the cells where
    another planner beats hybrid (with the fastest such planner), the worst cell against
    TorchRec, per-cluster figures, and hybrid's gap to its bound on the `slow` clusters'
    cells (`slow_mixed`), each cell listed."""
    cells: dict[tuple[str, str], dict[str, dict]] = {}
    for r in rows:
        cells.setdefault((r["suite"], r["cluster"]), {})[r["planner"]] = r
    wins = {p: 0 for p in GRID_PLANNERS}
    losses, ties, clusters = [], [], {}
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
            hybrid_ms = h["est_step_ms"] if h["feasible"] else None
            entry = {
                "suite": suite,
                "cluster": cluster,
                "planner": p,
                "planner_ms": others[p],
                "hybrid_ms": hybrid_ms,
            }
            if not h["feasible"] or others[p] < h["est_step_ms"] * (1 - TIE):
                losses.append(entry)
            elif others[p] < h["est_step_ms"]:  # faster, but within TIE
                ties.append(entry)
        c = clusters.setdefault(
            cluster,
            {
                "cells": 0,
                "speedups": [],
                "gaps": [],
                "hybrid_feasible": 0,
                "torchrec_feasible": 0,
                "only_hybrid_fits": 0,
            },
        )
        c["cells"] += 1
        if h["feasible"] and "gap_to_bound" in h:  # as the grid's median below
            c["gaps"].append(h["gap_to_bound"])
        c["hybrid_feasible"] += h["feasible"]
        c["torchrec_feasible"] += by["torchrec"]["feasible"]
        c["only_hybrid_fits"] += h["feasible"] and len(fits) == 1
        ratio = _ratio(by["torchrec"], h)
        if ratio is not None:
            c["speedups"].append(ratio)
            if worst is None or ratio < worst["speedup_vs_torchrec"]:
                worst = {
                    "suite": suite,
                    "cluster": cluster,
                    "speedup_vs_torchrec": ratio,
                    "hybrid_ms": h["est_step_ms"],
                    "torchrec_ms": by["torchrec"]["est_step_ms"],
                }
    for c in clusters.values():
        g = c.pop("gaps")
        c["median_gap_to_bound"] = float(np.median(g)) if g else None
        s = c.pop("speedups")
        c["median_speedup_vs_torchrec"] = float(np.median(s)) if s else None
        c["min_speedup_vs_torchrec"] = float(np.min(s)) if s else None
    # hybrid's feasible plans only (a plan that does not fit has a step and a bound too)
    gaps = [
        r["gap_to_bound"]
        for r in rows
        if r["planner"] == "hybrid" and r["feasible"] and "gap_to_bound" in r
    ]
    cut = [r for r in rows if r["planner"] == "torchrec" and r.get("search_cut")]
    # every cell's planning, whichever run planned it (torchrec_own shares torchrec's search)
    seconds = sum(r["planning_s"] for r in rows if r["planner"] != "torchrec_own")
    on_slow = [
        {"suite": r["suite"], "cluster": r["cluster"], "gap_to_bound": r["gap_to_bound"]}
        for r in rows
        if r["planner"] == "hybrid"
        and r["cluster"] in slow
        and r["feasible"]
        and "gap_to_bound" in r
    ]
    sg = [c["gap_to_bound"] for c in on_slow]
    slow_summary = {
        "clusters": list(slow),
        "link_gbit_s_at_most": SLOW_LINK_GBIT_S,
        "cells": on_slow,
        "median_gap_to_bound": float(np.median(sg)) if sg else None,
        "max_gap_to_bound": float(np.max(sg)) if sg else None,
    }
    return {
        "cells": rows,
        "wins": wins,
        "hybrid_losses": losses,
        "hybrid_ties": ties,
        "slow_mixed": slow_summary,
        "worst_vs_torchrec": worst,
        "clusters": clusters,
        "cell_count": len(cells),
        "median_gap_to_bound": float(np.median(gaps)) if gaps else None,
        "max_gap_to_bound": float(np.max(gaps)) if gaps else None,
        "torchrec_searches_cut": len(cut),
        "cell_seconds": seconds,
    }


def write_csv(rows: list[dict], path: Path) -> None:
    keys = [
        "suite",
        "cluster",
        "planner",
        "est_step_ms",
        "feasible",
        "lower_bound_ms",
        "gap_to_bound",
        "planning_s",
        "search_s",
        "search_limit_s",
        "search_cut",
        "tables",
        "weights_gb",
    ]
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
            ax.scatter(
                only,
                [top] * len(only),
                marker="^",
                color="tab:green",
                s=18,
                label="TorchRec finds no plan",
            )
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
    fig.suptitle(
        "Hybrid vs TorchRec's best plan per grid cell (above 1: hybrid faster)", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(grid: dict) -> list[str]:
    lines = [
        "",
        f"## Grid: {grid['cell_count']} cells (workload x cluster), every planner",
        "",
        "| cluster | cells | hybrid fits | TorchRec fits | only hybrid fits | "
        "median speedup vs TorchRec | min |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, c in grid["clusters"].items():
        med, low = (
            f"{x:.2f}x" if x else "-"
            for x in (c["median_speedup_vs_torchrec"], c["min_speedup_vs_torchrec"])
        )
        lines.append(
            f"| {name} | {c['cells']} | {c['hybrid_feasible']} | "
            f"{c['torchrec_feasible']} | {c['only_hybrid_fits']} | {med} | "
            f"{low} |"
        )
    wins = ", ".join(f"{p} {n}" for p, n in grid["wins"].items())
    worst = grid["worst_vs_torchrec"]
    losses = len(grid["hybrid_losses"])
    ties = len(grid.get("hybrid_ties", []))
    lines += [
        "",
        f"Wins (fastest feasible plan of a cell; within {TIE:.1%} a tie, to each): {wins}.",
        f"Cells where another planner beats hybrid by more than {TIE:.1%}: "
        f"{losses}; ties (another planner faster by less): {ties}.",
    ]
    if grid.get("median_gap_to_bound"):
        lines.append(
            f"Hybrid's gap to the lower bound: median {grid['median_gap_to_bound']:.3f}x, "
            f"largest {grid['max_gap_to_bound']:.3f}x. TorchRec searches stopped at "
            f"their time limit: {grid['torchrec_searches_cut']}."
        )
    sm = grid.get("slow_mixed") or {}
    if sm.get("median_gap_to_bound"):
        lines.append(
            f"On mixed clusters of several nodes joined at or below "
            f"{sm['link_gbit_s_at_most']:g} Gbit/s ({', '.join(sm['clusters'])}; "
            f"{len(sm['cells'])} cells hybrid fits) hybrid's gap to the lower bound: "
            f"median {sm['median_gap_to_bound']:.3f}x, largest "
            f"{sm['max_gap_to_bound']:.3f}x."
        )
    if worst:
        lines.append(
            f"Worst cell against TorchRec: {worst['suite']} on {worst['cluster']}, "
            f"{worst['speedup_vs_torchrec']:.2f}x ({worst['hybrid_ms']:.2f} ms vs "
            f"{worst['torchrec_ms']:.2f} ms)."
        )
    for loss in grid["hybrid_losses"][:20]:
        hybrid = "no plan" if loss["hybrid_ms"] is None else f"{loss['hybrid_ms']:.2f} ms"
        lines.append(
            f"- {loss['suite']} on {loss['cluster']}: {loss['planner']} "
            f"{loss['planner_ms']:.2f} ms vs hybrid {hybrid}"
        )
    return lines
