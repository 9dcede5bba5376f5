"""`python -m benchmarks.planners`: the four planners side by side, judged by one cost model.

For each mixed cluster preset: predicted step time of hybrid / torchrec / greedy_size /
round_robin plans of the MLPerf DLRM-DCNv2 tables, each plan's gap to the lower bound, its
all-to-all bytes and its planning time; then planning speed at scale (the MLPerf tables on
hetero_64, and 1,000 tables on 1,536 devices). Access frequencies: a power law
(`zipf_exponent`), as `sharding.plan` assumes without a profile. These are predictions of
the cost model, not measurements of training (GPU clusters cannot be run here).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import numpy as np
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from benchmarks.common import environment, finish, start
from sharding.cost_model import TableStats

REPO = Path(__file__).resolve().parents[1]


@dataclass
class PlannerBenchConfig:
    clusters: list[str] = field(
        default_factory=lambda: ["hetero_3node", "hetero_64", "2x8_h100", "1x8_a100_80g"]
    )
    planners: list[str] = field(
        default_factory=lambda: ["hybrid", "torchrec", "greedy_size", "round_robin"]
    )
    model: str = "dcnv2_mlperf"
    batch_size: int = 2048  # per rank
    scale_tables: int = 1000
    scale_devices: int = 1536  # 192 nodes x 8
    results_dir: str = str(REPO / "benchmarks" / "results" / "planners")


def _compose(overrides: list[str]):
    from recsys.train import to_typed

    return to_typed(hydra.compose(config_name="plan", overrides=overrides))


def compare(cfg: PlannerBenchConfig) -> list[dict]:
    import recsys.planning as cli

    rows = []
    for cluster in cfg.clusters:
        base = [f"cluster={cluster}", f"model={cfg.model}", f"trainer.batch_size={cfg.batch_size}"]
        inputs = cli.plan_inputs(_compose(base), None, None)
        variants = [(p, []) for p in cfg.planners]
        if "hybrid" in cfg.planners:  # hybrid with TorchRec's pooled exchange for cold parts
            variants.append(("hybrid+pooled", ["planner.cold_only_exchange=false"]))
        for planner, extra in variants:
            name = planner.split("+")[0]
            inputs.cold_only_exchange = not extra
            plan = cli.make_plan(_compose(base + [f"planner={name}", *extra]), inputs)
            rows.append({"cluster": cluster, "planner": planner, "est_step_ms": plan.est_step_ms,
                         "lower_bound_ms": plan.lower_bound_ms, "planning_s": plan.planning_s,
                         "a2a_bytes_per_step": plan.a2a_bytes_per_step,
                         "feasible": plan.feasible})  # fmt: skip
            line = f"{cluster:14} {planner:12} {plan.est_step_ms:9.2f} ms"
            print(f"{line}  (bound {plan.lower_bound_ms:.2f})  {plan.planning_s:.2f} s", flush=True)
    return rows


def at_scale(cfg: PlannerBenchConfig) -> dict:
    """Hybrid planning time: 1,000 tables (Criteo-like sizes) on 1,536 mixed devices."""
    import recsys.planning as cli
    from sharding.planners import hybrid
    from sharding.types import ClusterSpec, DeviceGroup, NodeGroup

    nodes = cfg.scale_devices // 8
    spec = ClusterSpec(
        name=f"{cfg.scale_devices}_mixed",
        nodes=[
            NodeGroup(count=nodes // 2, host_memory_gb=2048, devices=[DeviceGroup("h100_80g", 8)]),
            NodeGroup(count=nodes - nodes // 2, host_memory_gb=1024,
                      devices=[DeviceGroup("a100_40g", 4), DeviceGroup("v100_32g", 4)]),
        ],
    )  # fmt: skip
    base = _compose([f"model={cfg.model}", f"trainer.batch_size={cfg.batch_size}"])
    base.cluster = spec
    inputs = cli.plan_inputs(base, None, None)
    rng = np.random.default_rng(0)
    sizes = rng.choice([10, 1_000, 100_000, 1_000_000, 10_000_000], cfg.scale_tables,
                       p=[0.2, 0.3, 0.3, 0.15, 0.05])  # fmt: skip
    inputs.tables = [TableStats(f"t{i}", int(r), 128) for i, r in enumerate(sizes)]
    from sharding.plan_eval import evaluate, power_law_coverage

    inputs.coverage = {t.name: power_law_coverage(t.rows, 1.1) for t in inputs.tables}
    start = time.perf_counter()
    plan = hybrid(inputs)
    planning_s = time.perf_counter() - start
    evaluate(plan, inputs)
    return {"tables": cfg.scale_tables, "devices": inputs.world, "planning_s": planning_s,
            "feasible": plan.feasible, "est_step_ms": plan.est_step_ms,
            "lower_bound_ms": plan.lower_bound_ms}  # fmt: skip


def table(r: dict) -> str:
    env = r["environment"]
    lines = [f"# Planners side by side ({env['date']}, torch {env['torch']}, torchrec "
             f"{env['torchrec']}; predictions of the cost model, model {r['config']['model']}, "
             f"batch {r['config']['batch_size']} per rank, power-law access)",
             "", "| cluster | planner | predicted ms/step | speedup vs torchrec | / lower bound | "
             "a2a MB/step | planning s |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    by = {(x["cluster"], x["planner"]): x for x in r["compare"]}
    for x in r["compare"]:
        tr = by.get((x["cluster"], "torchrec"))
        ratio = f"{tr['est_step_ms'] / x['est_step_ms']:.2f}x" if tr else "-"
        lines.append(f"| {x['cluster']} | {x['planner']} | {x['est_step_ms']:.2f} | {ratio} | "
                     f"{x['est_step_ms'] / x['lower_bound_ms']:.2f}x | "
                     f"{x['a2a_bytes_per_step'] / 1e6:.1f} | {x['planning_s']:.2f} |")  # fmt: skip
    s = r["scale"]
    lines += ["", f"Hybrid at scale: {s['tables']:,} tables on {s['devices']:,} devices planned in "
              f"{s['planning_s']:.1f} s (goal 60 s), {s['est_step_ms'] / s['lower_bound_ms']:.2f}x "
              f"the lower bound."]  # fmt: skip
    return "\n".join(lines)


ConfigStore.instance().store(name="base_bench_planners", node=PlannerBenchConfig)


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench_planners")
def main(cfg: DictConfig) -> None:
    typed: PlannerBenchConfig = start(cfg)
    result = {"config": OmegaConf.to_container(cfg), "environment": environment(),
              "compare": compare(typed), "scale": at_scale(typed)}  # fmt: skip
    finish(result, table(result), "planners", typed.results_dir)


if __name__ == "__main__":
    main()
