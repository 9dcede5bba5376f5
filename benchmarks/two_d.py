"""`python -m benchmarks.two_d`: would synchronous 2D sparse parallelism beat hybrid's plan?

For each size W in `workers` of each family (conf/families/) and each group size G in
`groups` that divides W into whole nodes (G < W), hybrid plans one group: G ranks at the
same batch per rank. `sharding.two_d` prices the 2D step on W ranks from that plan (see its
docstring), and hybrid's own plan on W ranks is priced beside it; the step simulator
(`sharding.simulate`, as in `benchmarks.scale`) runs hybrid's plan under each exact schedule
in `schedules` and the 2D plan under those 2D groups train under (`pipelines.two_d`: the
plain loop and TorchRec's pipelines, not nested), and the best of each is compared. A group
plan that does not fit its G ranks' memory is listed as such.

Writes summary.json (`points`: `family`, `workers`, `group`, `step_ms`, `schedule`,
`sync_ms`, `feasible`, `vs_hybrid`; `hybrid`: per family and size, hybrid's best exact step)
and two_d.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from benchmarks.common import benchmark_command, environment, finish, start
from benchmarks.scale import RESULTS, ScaleConfig
from pipelines.types import TWO_D_PIPELINES
from recsys import CONF_DIR


@dataclass
class TwoDConfig(ScaleConfig):
    workers: list[int] = field(default_factory=lambda: [64, 128, 512, 1536])
    groups: list[int] = field(default_factory=lambda: [8, 16, 32, 64, 128, 256, 512])
    schedules: list[str] = field(
        default_factory=lambda: ["plain", "sparse_dist", "nested2", "nested4", "nested8"]
    )  # exact schedules only: 2D is judged by the plain loop's result
    precision: str = "bf16"
    profile: str | None = str(RESULTS / "scale" / "profile_mlperf_multihot.json")
    validation: bool = False
    results_dir: str = str(RESULTS / "two_d")


def best_step(cost, labels: dict, plan, inputs, profile) -> tuple[float, str]:
    """The fastest simulated step (ms) of `cost` over the schedules, and its schedule."""
    from benchmarks.scale import simulate_label

    steps = {
        label: simulate_label(cost, parsed, plan, inputs, profile)[0].step_s
        for label, parsed in labels.items()
    }
    label = min(steps, key=steps.get)
    return 1000 * steps[label], label


def two_d_points(cfg: TwoDConfig) -> tuple[list[dict], list[dict]]:
    from benchmarks.scale import cluster_at, plan_at, schedules_and_profile
    from sharding.cost_model import allreduce_s
    from sharding.plan_eval import plan_cost
    from sharding.two_d import replica_sync_bytes, two_d_cost

    labels, profile = schedules_and_profile(cfg)
    if any(x.stale for x in labels.values()):
        raise SystemExit("benchmarks.two_d: schedules must be exact (no semi_sync)")
    # 2D groups get the schedules they train under (pipelines.types.TWO_D_PIPELINES)
    trained = {k: v for k, v in labels.items() if k in {p.value for p in TWO_D_PIPELINES}}
    if not trained:
        raise SystemExit(
            f"benchmarks.two_d: schedules={list(labels)} has none that 2D groups "
            f"train under ({[p.value for p in TWO_D_PIPELINES]})"
        )
    points, hybrid = [], []
    for family, how in cfg.families.items():
        for workers in cfg.workers:
            spec = cluster_at(family, how, workers, cfg.oversubscription, cfg.allreduce)
            if spec is None:
                continue
            plan, inputs, planning_s = plan_at(cfg, spec, "hybrid", profile)
            ms, label = best_step(plan_cost(plan, inputs), labels, plan, inputs, profile)
            hybrid.append(
                {
                    "family": family,
                    "workers": workers,
                    "step_ms": ms,
                    "schedule": label,
                    "feasible": plan.feasible,
                }
            )
            print(
                f"{family} {workers:>5}: hybrid {ms:.2f} ms ({label}, planned in "
                f"{planning_s:.1f} s)",
                flush=True,
            )
            for group in cfg.groups:
                if group >= workers or workers % group:
                    continue
                gspec = cluster_at(family, how, group, cfg.oversubscription, cfg.allreduce)
                if gspec is None:  # not whole nodes
                    continue
                gplan, ginputs, _ = plan_at(cfg, gspec, "hybrid", profile)
                cost = two_d_cost(
                    gplan, plan_cost(gplan, ginputs), ginputs, workers, inputs.network
                )
                gms, glabel = best_step(cost, trained, gplan, ginputs, profile)
                sync = replica_sync_bytes(gplan, ginputs, workers)
                points.append(
                    {
                        "family": family,
                        "workers": workers,
                        "group": group,
                        "step_ms": gms,
                        "schedule": glabel,
                        "feasible": gplan.feasible,
                        "sync_ms": 1000 * allreduce_s(sync, workers // group, inputs.network),
                        "sync_mb_per_rank": sync / 2**20,
                        "vs_hybrid": ms / gms,
                    }
                )
                print(
                    f"  2D groups of {group}: {gms:.2f} ms ({glabel}; replica sync "
                    f"{points[-1]['sync_ms']:.2f} ms) -> hybrid / 2D "
                    f"{points[-1]['vs_hybrid']:.2f}x",
                    flush=True,
                )
    return points, hybrid


def table(result: dict) -> str:
    c = result["config"]
    lines = [
        f"# Synchronous 2D groups against hybrid's plan (simulated; "
        f"{result['environment']['date']}, model {c['model']}, batch "
        f"{c['batch_per_worker']} per worker, dense in {c['precision']})",
        "",
        "| family | workers | plan | best exact step ms | schedule | replica sync ms | "
        "fits | hybrid / this |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for h in result["hybrid"]:
        lines.append(
            f"| {h['family']} | {h['workers']} | hybrid | {h['step_ms']:.2f} | "
            f"{h['schedule']} | - | {h['feasible']} | 1.00x |"
        )
        for p in result["points"]:
            if (p["family"], p["workers"]) == (h["family"], h["workers"]):
                lines.append(
                    f"| | | 2D groups of {p['group']} | {p['step_ms']:.2f} | "
                    f"{p['schedule']} | {p['sync_ms']:.2f} | {p['feasible']} | "
                    f"{p['vs_hybrid']:.2f}x |"
                )
    return "\n".join(lines)


ConfigStore.instance().store(name="base_bench_two_d", node=TwoDConfig)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="bench_two_d")
@benchmark_command
def main(cfg: DictConfig) -> None:
    from recsys.config import register_configs

    register_configs()
    typed: TwoDConfig = start(cfg)
    t0 = time.perf_counter()
    result: dict = {"config": OmegaConf.to_container(cfg), "environment": environment()}
    result["points"], result["hybrid"] = two_d_points(typed)
    result["elapsed_s"] = time.perf_counter() - t0
    finish(result, table(result), "two_d", typed, json_name="summary")


if __name__ == "__main__":
    main()
