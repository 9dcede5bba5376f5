"""`python -m benchmarks.grid_recheck`: the planner grid's cells where TorchRec's search hit
its limit, searched again for longer. Does any verdict change?

Reads the published grid (`benchmarks/results/planners/grid_cells.jsonl`), takes the `cells`
cells whose TorchRec search was cut where hybrid's lead over TorchRec's best plan is
smallest (both with a plan that fits; `hybrid / TorchRec` largest first), rebuilds each
cell's inputs as the grid does (`benchmarks.planners.grid_inputs`) and plans it again with
TorchRec's planner given `limit_s` seconds, `workers` cells at once. A verdict changes where
the longer search's best plan is faster than hybrid's by more than the grid's tie (0.5%).

Writes summary.json (`cells`: suite, cluster, tables, hybrid_ms, torchrec_ms (the grid's),
grid_search_s, torchrec_longer_ms, search_s, cut_again, verdict_changed; `changed`: how
many) and grid_recheck.md.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from dataclasses import dataclass, field
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from benchmarks.common import benchmark_command, environment, finish, start
from benchmarks.planner_grid import CELLS_FILE, TIE, workload_for
from benchmarks.planners import PlannerBenchConfig
from recsys import CONF_DIR

REPO = Path(__file__).resolve().parents[1]


@dataclass
class RecheckConfig:
    cells: int = 12  # the cut cells closest to a TorchRec win
    limit_s: float = 240.0  # TorchRec's search per cell (the grid's floor is 30 s)
    workers: int = 2
    grid: str = str(REPO / "benchmarks" / "results" / "planners" / CELLS_FILE)
    # the planner benchmark whose grid it re-plans (its clusters and workloads)
    grid_bench: PlannerBenchConfig = field(default_factory=PlannerBenchConfig)
    save: bool = False
    results_dir: str = str(REPO / "benchmarks" / "results" / "grid_recheck")


def closest_cut_cells(rows: list[dict], n: int) -> list[dict]:
    """The `n` cells whose TorchRec search was cut, both planners with a plan that fits,
    hybrid's lead smallest first."""
    cells: dict[tuple[str, str], dict[str, dict]] = {}
    for r in rows:
        cells.setdefault((r["suite"], r["cluster"]), {})[r["planner"]] = r
    cut = []
    for (suite, cluster), by in cells.items():
        h, t = by["hybrid"], by["torchrec"]
        if t.get("search_cut") and h["feasible"] and t["feasible"]:
            cut.append(
                {
                    "suite": suite,
                    "cluster": cluster,
                    "tables": h["tables"],
                    "hybrid_ms": h["est_step_ms"],
                    "torchrec_ms": t["est_step_ms"],
                    "grid_search_s": t["search_s"],
                }
            )
    cut.sort(key=lambda c: -c["hybrid_ms"] / c["torchrec_ms"])
    return cut[:n]


_INPUTS: dict = {}  # (suite, cluster) -> PlanInputs, filled before the workers fork
_LIMIT: list[float] = [0.0]


def _search(cell: dict) -> dict:
    from sharding.plan_eval import evaluate
    from sharding.torchrec_planner import torchrec_plans
    from sharding.types import PlanDoesNotFitError, PlannerConfig

    inputs = _INPUTS[cell["suite"], cell["cluster"]]
    start_s = time.perf_counter()
    try:
        tr = torchrec_plans(inputs, PlannerConfig(torchrec_timeout_s=_LIMIT[0]))
        plan, search_s = evaluate(tr.best_ours, inputs, bound=False), tr.result.planning_s
        ms = plan.est_step_ms if plan.feasible else None
    except PlanDoesNotFitError:
        ms, search_s = None, time.perf_counter() - start_s
    verdict = ms is not None and ms < cell["hybrid_ms"] * (1 - TIE)
    return {
        **cell,
        "torchrec_longer_ms": ms,
        "search_s": search_s,
        "cut_again": search_s >= _LIMIT[0],
        "verdict_changed": verdict,
    }


def recheck(cfg: RecheckConfig) -> dict:
    from benchmarks.planner_grid import grid_workloads
    from benchmarks.planners import grid_inputs

    lines = Path(cfg.grid).read_text().splitlines()
    rows = [r for line in lines[1:] for r in json.loads(line)]
    chosen = closest_cut_cells(rows, cfg.cells)
    clusters, named = grid_inputs(cfg.grid_bench, Path(cfg.grid).parent)
    workloads = {w.name: w for w in grid_workloads(cfg.grid_bench.grid, named, len(clusters))}
    _INPUTS.clear()
    for c in chosen:
        _INPUTS[c["suite"], c["cluster"]] = workload_for(
            clusters[c["cluster"]], workloads[c["suite"]]
        )
    _LIMIT[0] = cfg.limit_s
    out = []
    with mp.get_context("fork").Pool(cfg.workers, maxtasksperchild=1) as pool:
        for done, cell in enumerate(pool.imap_unordered(_search, chosen), 1):
            out.append(cell)
            longer = cell["torchrec_longer_ms"]
            print(
                f"[{done}/{len(chosen)}] {cell['cluster']:14} {cell['suite']:12} hybrid "
                f"{cell['hybrid_ms']:.2f} ms, TorchRec {cell['torchrec_ms']:.2f} -> "
                f"{'-' if longer is None else f'{longer:.2f}'} ms in {cell['search_s']:.0f} s",
                flush=True,
            )
    out.sort(key=lambda c: -c["hybrid_ms"] / c["torchrec_ms"])
    return {"cells": out, "changed": sum(c["verdict_changed"] for c in out)}


def table(result: dict) -> str:
    c = result["config"]
    lines = [
        f"# The grid's cut TorchRec searches, searched for {c['limit_s']:.0f} s "
        f"({result['environment']['date']}; the {c['cells']} cells closest to a "
        f"TorchRec win)",
        "",
        f"Verdicts changed (TorchRec faster than hybrid by more than {TIE:.1%}): "
        f"{result['changed']} of {len(result['cells'])}.",
        "",
        "| cluster | suite | tables | hybrid ms | TorchRec ms (grid) | grid search s | "
        "TorchRec ms (longer) | search s | cut again | hybrid's speed-up over it |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in result["cells"]:
        longer = x["torchrec_longer_ms"]
        ratio = "-" if longer is None else f"{longer / x['hybrid_ms']:.3f}x"
        lines.append(
            f"| {x['cluster']} | {x['suite']} | {x['tables']} | {x['hybrid_ms']:.2f} | "
            f"{x['torchrec_ms']:.2f} | {x['grid_search_s']:.0f} | "
            f"{'-' if longer is None else f'{longer:.2f}'} | {x['search_s']:.0f} | "
            f"{'yes' if x['cut_again'] else 'no'} | {ratio} |"
        )
    return "\n".join(lines)


ConfigStore.instance().store(name="base_bench_grid_recheck", node=RecheckConfig)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="bench_grid_recheck")
@benchmark_command
def main(cfg: DictConfig) -> None:
    from recsys.config import register_configs

    register_configs()
    typed: RecheckConfig = start(cfg)
    t0 = time.perf_counter()
    result: dict = {"config": OmegaConf.to_container(cfg), "environment": environment()}
    result.update(recheck(typed))
    result["elapsed_s"] = time.perf_counter() - t0
    finish(result, table(result), "grid_recheck", typed, json_name="summary")


if __name__ == "__main__":
    main()
