"""`python -m benchmarks.planners`: the planners side by side, judged by one cost model.

1. Presets: the MLPerf DLRM-DCNv2 tables on each mixed and homogeneous cluster preset, planned
   by hybrid, by TorchRec's planner configured fairly (`sharding.torchrec_planner`: its own
   choice, and the fastest under our cost model of every plan it rated), greedy_size and
   round_robin, and the alternatives of leaving devices out (hybrid weighing parts of the
   cluster, TorchRec's planner on the best part); each plan's gap to the lower bound; and
   where hybrid's gain comes from:
   TorchRec -> TorchRec's placement with speed-aware batch shares -> hybrid with whole-table
   replication only -> + speed-aware shares -> + hot-row replication -> + row parts.
2. The grid (`benchmarks.planner_grid`): many workloads x clusters x planners.
3. At scale (`at_scale=true`): hybrid's planning time for 1,000 tables on 1,536 devices,
   on 16 ranks, and for MLPerf DCNv2 with multi-hot bags on 512 H100s.
All figures are predictions of the cost model (GPU clusters cannot be run here). Writes
summary.json (`presets`, `grid`, `scale`), planners.md, grid.csv and grid.png.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import numpy as np
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from benchmarks import plots
from benchmarks.common import benchmark_command, environment, finish, output_dirs, start
from benchmarks.planner_grid import (
    PROFILE_FILE,
    GridConfig,
    named_workloads,
    plot,
    run_grid,
    write_csv,
)
from benchmarks.planner_grid import table as grid_table
from recsys import CONF_DIR
from sharding.suites import Workload
from sharding.types import TableStats

REPO = Path(__file__).resolve().parents[1]
# the gain decomposition: each step adds one of hybrid's ideas to the one before
STEPS = [
    ("torchrec", "TorchRec's best plan (fair topology)"),
    ("torchrec+speed_shares", "TorchRec's placement, speed-aware batch shares"),
    ("hybrid_whole_tables", "hybrid: whole-table replication only, equal shares"),
    ("+speed_shares", "+ speed-aware batch shares"),
    ("+hot_rows", "+ hot-row replication (cold parts exchanged alone)"),
    ("+row_parts", "+ cold parts in row parts (= hybrid)"),
]


@dataclass
class PlannerBenchConfig:
    clusters: list[str] = field(
        default_factory=lambda: ["hetero_3node", "hetero_64", "2x8_h100", "1x8_a100_80g"]
    )
    model: str = "dcnv2_mlperf"
    batch_size: int = 2048  # per rank
    # the dense part's (`trainer.precision`), priced alike for every planner: bf16, what
    # large GPU runs use; V100 and T4 have no bf16 tensor cores and are priced at fp32
    precision: str = "bf16"
    at_scale: bool = True
    scale_tables: int = 1000
    scale_devices: int = 1536  # 192 nodes x 8
    grid: GridConfig = field(default_factory=GridConfig)
    save: bool = False  # also write benchmarks/results/ (see common.output_dirs)
    results_dir: str = str(REPO / "benchmarks" / "results" / "planners")


def _compose(overrides: list[str]):
    from recsys.app.train import to_typed

    return to_typed(hydra.compose(config_name="plan", overrides=overrides))


def _base(cfg: PlannerBenchConfig, cluster: str | None = None) -> list[str]:
    return [
        f"model={cfg.model}",
        f"trainer.batch_size={cfg.batch_size}",
        f"trainer.precision={cfg.precision}",
    ] + ([f"cluster={cluster}"] if cluster else [])


def preset(cfg: PlannerBenchConfig, cluster: str) -> dict:
    """Every planner on one preset, and the gain decomposition."""
    import recsys.app.planning as cli
    from sharding.hybrid import HybridOptions, hybrid, with_speed_aware_batch
    from sharding.plan_eval import evaluate
    from sharding.planners import PLANNERS

    typed = _compose(_base(cfg, cluster))
    inputs = cli.plan_inputs(typed, None, None)
    planners = {}

    def timed(name: str, make, judged: bool = False) -> None:
        begin = time.perf_counter()
        plan = make()
        seconds = time.perf_counter() - begin
        plan = plan if judged else evaluate(plan, inputs)  # judged: on its own part
        batch = plan.batch_per_rank
        planners[name] = {
            "est_step_ms": plan.est_step_ms,
            "lower_bound_ms": plan.lower_bound_ms,
            "planning_s": seconds,
            "a2a_bytes_per_step": plan.a2a_bytes_per_step,
            "feasible": plan.feasible,
            "batch_range": [min(batch), max(batch)],
            "left_out": plan.left_out,  # the cluster's ranks a plan for part of it leaves out
        }
        print(
            f"{cluster:14} {name:14} {plan.est_step_ms:9.2f} ms (bound {plan.lower_bound_ms:.2f})"
            f"  {seconds:.2f} s",
            flush=True,
        )

    begin = time.perf_counter()
    tr = cli.torchrec_plans(typed, inputs)
    tr_s = time.perf_counter() - begin
    timed("hybrid", lambda: PLANNERS["hybrid"](inputs))
    timed("torchrec", lambda: tr.best_ours)
    timed("torchrec_own", lambda: tr.chosen)
    for name in ("greedy_size", "round_robin"):
        timed(name, lambda name=name: PLANNERS[name](inputs))
    for name in ("torchrec", "torchrec_own"):
        planners[name]["planning_s"] = tr_s
    # what a user might do instead: hybrid as it plans by default, weighing parts of the
    # cluster (planner.leave_out), and TorchRec's planner on the best part of it
    timed(
        "hybrid+parts",
        lambda: cli.make_plan(_compose([*_base(cfg, cluster), "planner=hybrid"]), inputs),
        judged=True,
    )
    timed("torchrec@best_part", lambda: _torchrec_on_best_part(typed, inputs), judged=True)
    steps = {
        "torchrec": tr.best_ours,
        "torchrec+speed_shares": with_speed_aware_batch(tr.best_ours, inputs),
        "hybrid_whole_tables": hybrid(inputs, HybridOptions(False, False, False)),
        "+speed_shares": hybrid(inputs, HybridOptions(True, False, False)),
        "+hot_rows": hybrid(inputs, HybridOptions(True, True, False)),
        "+row_parts": hybrid(inputs, HybridOptions(True, True, True)),
    }
    decomposition = [
        {"step": key, "what": what, "ms": evaluate(steps[key], inputs, bound=False).est_step_ms}
        for key, what in STEPS
    ]
    return {
        "torchrec_ms": planners["torchrec"]["est_step_ms"],
        "torchrec_own_best_ms": planners["torchrec_own"]["est_step_ms"],
        "torchrec_own_estimate_ms": tr.own_estimate_ms,
        "torchrec_proposals": tr.proposals,
        "hybrid_ms": planners["hybrid"]["est_step_ms"],
        "lower_bound_ms": planners["hybrid"]["lower_bound_ms"],
        "schedule": inputs.schedule.value,
        "decomposition": decomposition,
        "planners": planners,
    }


def _torchrec_on_best_part(typed, inputs):
    """TorchRec's plan (its best under our cost model) on each part of the cluster
    (`sharding.subsets.candidates`) at the same global batch, the fastest, naming the ranks
    it leaves out; TorchRec's plan on every device where no part holds the model."""
    import recsys.app.planning as cli
    from sharding.errors import UserError
    from sharding.plan_eval import evaluate
    from sharding.subsets import candidates

    best = None
    for keep, _ in candidates(typed.cluster):
        try:
            part_cfg, part = cli.on_part(typed, inputs, keep)
            plan = evaluate(cli.torchrec_plans(part_cfg, part).best_ours, part)
        except UserError:
            continue
        plan.left_out = [r for r in range(inputs.world) if r not in keep]
        if plan.feasible and (best is None or plan.est_step_ms < best.est_step_ms):
            best = plan
    return best or evaluate(cli.torchrec_plans(typed, inputs).best_ours, inputs)


def mlperf_workload(cfg: PlannerBenchConfig) -> Workload:
    import recsys.app.planning as cli

    inputs = cli.plan_inputs(_compose(_base(cfg, "1x8_a100_80g")), None, None)
    return Workload(
        "mlperf_dcnv2",
        inputs.tables,
        inputs.coverage,
        inputs.dense_params,
        inputs.interaction_flops_per_sample,
        inputs.activation_bytes_per_sample,
        {"model": cfg.model, "profile": "power law, exponent 1.1"},
    )


def grid(cfg: PlannerBenchConfig, out_dir: Path) -> dict:
    clusters, named = grid_inputs(cfg, out_dir)
    return run_grid(cfg.grid, clusters, named, out_dir)


def grid_inputs(cfg: PlannerBenchConfig, out_dir: Path) -> tuple[dict, list[Workload]]:
    """The grid's clusters (the presets, then the generated layouts) and named workloads."""
    import recsys.app.planning as cli
    from sharding.layouts import random_layout

    clusters = {c: cli.plan_inputs(_compose(_base(cfg, c)), None, None) for c in cfg.grid.clusters}
    for i in range(cfg.grid.layouts):  # layouts nobody tuned for
        base = _compose(_base(cfg))
        base.cluster = random_layout(cfg.grid.layout_seed + i, cfg.grid.layout_max_ranks)
        clusters[base.cluster.name] = cli.plan_inputs(base, None, None)
    # the measured profile is reused: the published one if there is one, else this run's
    published = Path(cfg.results_dir)
    where = published if (published / PROFILE_FILE).exists() else out_dir
    return clusters, named_workloads(cfg.grid, mlperf_workload(cfg), where)


def at_scale(cfg: PlannerBenchConfig) -> dict:
    """Hybrid planning time: 1,000 tables (Criteo-like sizes) on 1,536 mixed devices, and
    the other planning-time goals (`goals`: `planning_time_goals`)."""
    import recsys.app.planning as cli
    from sharding.types import (
        ClusterSpec,
        DeviceGroup,
        NetworkSpec,
        NodeGroup,
        PowerLawCoverage,
    )

    nodes = cfg.scale_devices // 8
    spec = ClusterSpec(
        name=f"{cfg.scale_devices}_mixed",
        nodes=[
            NodeGroup(count=nodes // 2, host_memory_gib=2048, devices=[DeviceGroup("h100_80g", 8)]),
            NodeGroup(
                count=nodes - nodes // 2,
                host_memory_gib=1024,
                devices=[DeviceGroup("a100_40g", 4), DeviceGroup("v100_32g", 4)],
            ),
        ],
        network=NetworkSpec(intra_node_gbit_s=100.0, inter_node_gbit_s=25.0),
    )
    base = _compose(_base(cfg))
    base.cluster = spec
    inputs = cli.plan_inputs(base, None, None)
    rng = np.random.default_rng(0)
    sizes = rng.choice(
        [10, 1_000, 100_000, 1_000_000, 10_000_000], cfg.scale_tables, p=[0.2, 0.3, 0.3, 0.15, 0.05]
    )
    inputs.tables = [TableStats(f"t{i}", int(r), 128) for i, r in enumerate(sizes)]
    inputs.coverage = {t.name: PowerLawCoverage(t.rows, 1.1) for t in inputs.tables}
    return {"tables": cfg.scale_tables, **_timed_hybrid(inputs), "goals": planning_time_goals(cfg)}


def _timed_hybrid(inputs) -> dict:
    """Hybrid's plan of `inputs`, timed (every search on), with its step and bound."""
    from sharding.plan_eval import evaluate
    from sharding.planners import hybrid

    begin = time.perf_counter()
    plan = hybrid(inputs)
    planning_s = time.perf_counter() - begin
    evaluate(plan, inputs)
    return {
        "devices": inputs.world,
        "planning_s": planning_s,
        "feasible": plan.feasible,
        "est_step_ms": plan.est_step_ms,
        "lower_bound_ms": plan.lower_bound_ms,
    }


def planning_time_goals(cfg: PlannerBenchConfig) -> dict:
    """Hybrid's planning time where this project sets a goal besides the 1,000 x 1,536
    case: `scale_tables` random tables (`sharding.suites`, seed 0) on 2x8_h100's 16 ranks,
    and MLPerf DCNv2 with its multi-hot bags on 512 H100s (2x8_h100's nodes, 64 of them)."""
    from dataclasses import replace

    import recsys.app.planning as cli
    from benchmarks.planner_grid import workload_for
    from recsys.data.multi_hot import MLPERF_HOTNESS
    from sharding.suites import SuiteSpec, random_suite

    h100 = cli.plan_inputs(_compose(_base(cfg, "2x8_h100")), None, None)
    many = random_suite(0, SuiteSpec(tables=(cfg.scale_tables, cfg.scale_tables)))
    base = _compose(_base(cfg, "2x8_h100"))
    base.cluster = replace(
        base.cluster, name="64x8_h100", nodes=[replace(n, count=64) for n in base.cluster.nodes]
    )
    mlperf = cli.plan_inputs(base, None, None)
    mlperf.tables = [
        replace(t, lookups_per_sample=float(h))
        for t, h in zip(mlperf.tables, MLPERF_HOTNESS, strict=True)
    ]
    return {
        f"{cfg.scale_tables}_tables_16_ranks": {
            "tables": len(many.tables),
            **_timed_hybrid(workload_for(h100, many)),
        },
        "mlperf_multihot_512_h100": {"tables": len(mlperf.tables), **_timed_hybrid(mlperf)},
    }


def table(r: dict) -> str:
    env = r["environment"]
    lines = [
        f"# Planners side by side ({env['date']}, torch {env['torch']}, torchrec "
        f"{env['torchrec']}; predictions of the cost model, model {r['config']['model']}, "
        f"batch {r['config']['batch_size']} per rank)",
        "",
        "`torchrec`: the fastest under our cost model of every plan TorchRec's planner rated "
        "(fair topology); `torchrec_own`: the plan it picks by its own estimate; "
        "`hybrid+parts`: hybrid weighing parts of the cluster (`planner.leave_out`, its "
        "default); `torchrec@best_part`: TorchRec's plan on the fastest part of the cluster "
        "(whole nodes, the fastest device kinds), the rest left out. Every plan at the same "
        "global batch.",
        "",
        "| cluster | planner | predicted ms/step | speedup vs torchrec | / lower bound | "
        "a2a MB/step | planning s |",
        "|---|---|---|---|---|---|---|",
    ]
    for cluster, p in r["presets"].items():
        for name, x in p["planners"].items():
            lines.append(
                f"| {cluster} | {name} | {x['est_step_ms']:.2f} | "
                f"{p['torchrec_ms'] / x['est_step_ms']:.2f}x | "
                f"{x['est_step_ms'] / p['lower_bound_ms']:.2f}x | "
                f"{x['a2a_bytes_per_step'] / 1e6:.1f} | "
                f"{x['planning_s']:.2f} |"
            )
    lines += [
        "",
        "## Where hybrid's gain comes from (predicted ms/step)",
        "",
        "| step | " + " | ".join(r["presets"]) + " |",
        "|---|" + "---|" * len(r["presets"]),
    ]
    for i, (_, what) in enumerate(STEPS):
        cells = [f"{p['decomposition'][i]['ms']:.2f}" for p in r["presets"].values()]
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    if r.get("grid"):
        lines += grid_table(r["grid"])
    s = r.get("scale")
    if s:
        gap = s["est_step_ms"] / s["lower_bound_ms"]
        lines += [
            "",
            f"Hybrid at scale: {s['tables']:,} tables on {s['devices']:,} devices "
            f"planned in {s['planning_s']:.1f} s, {gap:.2f}x the lower bound.",
        ]
        for name, g in s.get("goals", {}).items():
            lines.append(
                f"{name}: {g['tables']:,} tables on {g['devices']:,} ranks planned in "
                f"{g['planning_s']:.1f} s, {g['est_step_ms'] / g['lower_bound_ms']:.2f}x "
                f"the lower bound."
            )
    return "\n".join(lines)


ConfigStore.instance().store(name="base_bench_planners", node=PlannerBenchConfig)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="bench_planners")
@benchmark_command
def main(cfg: DictConfig) -> None:
    typed: PlannerBenchConfig = start(cfg)
    dirs = output_dirs(typed)
    result = {
        "config": OmegaConf.to_container(cfg),
        "environment": environment(),
        "presets": {c: preset(typed, c) for c in typed.clusters},
    }
    if typed.grid.enabled:
        result["grid"] = grid(typed, dirs[-1])
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
            write_csv(result["grid"]["cells"], d / "grid.csv")
            plot(result["grid"], d / "grid.png")
    if typed.at_scale:
        result["scale"] = at_scale(typed)
    finish(
        result,
        table(result),
        "planners",
        typed,
        json_name="summary",
        picture=(plots.planner_gains, "planner_gains.png"),
    )


if __name__ == "__main__":
    main()
