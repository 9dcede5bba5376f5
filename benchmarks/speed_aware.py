"""`python -m benchmarks.speed_aware`: speed-aware vs speed-blind plans on ranks that really
differ in speed (`cluster=local_cpu3_skewed`: ranks 0 and 1 share core 0, rank 2 has core
1; or, as root, an emulated mixed cluster such as `cluster=emu_mixed4`, each rank in its
own cgroup), trained for real, side by side, interleaved `repeats` times; best samples/s
of each."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from benchmarks.common import benchmark_command, environment, finish, planner_overrides, start
from recsys import CONF_DIR
from recsys.config import register_configs
from sharding.types import ClusterSpec

REPO = Path(__file__).resolve().parents[1]


@dataclass
class SpeedAwareBenchConfig:
    cluster: ClusterSpec = field(default_factory=ClusterSpec)  # the group: local_cpu3_skewed
    # "+pooled": hybrid with TorchRec's pooled exchange for split tables' cold parts
    planners: list[str] = field(
        default_factory=lambda: ["round_robin", "torchrec", "hybrid+pooled", "hybrid"]
    )
    overrides: list[str] = field(default_factory=lambda: ["trainer.batch_size=1024"])
    steps: int = 80
    repeats: int = 2
    save: bool = False  # also write benchmarks/results/ (see common.output_dirs)
    results_dir: str = str(REPO / "benchmarks" / "results" / "speed_aware")


def run(cfg: SpeedAwareBenchConfig) -> dict:
    from recsys.app.train import train

    runs: dict[str, list[dict]] = {p: [] for p in cfg.planners}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(cfg.repeats):
            for planner in cfg.planners:
                overrides = [
                    f"cluster={cfg.cluster.name}",
                    *planner_overrides(planner),
                    *cfg.overrides,
                    f"trainer.max_steps={cfg.steps}",
                    "trainer.progress_bar=false",
                    "dataset.eval_batches=1",
                ]
                s = train(
                    hydra.compose(config_name="config", overrides=overrides),
                    Path(tmp) / f"{planner}_{rep}",
                )
                runs[planner].append(
                    {"samples_per_s": s["samples_per_s"], "batch_per_rank": s["batch_per_rank"]}
                )
                print(planner, rep, f"{s['samples_per_s']:,.0f} samples/s", s["batch_per_rank"])
    best = {p: max(r["samples_per_s"] for r in rs) for p, rs in runs.items()}
    blind = best[cfg.planners[0]]
    return {
        "runs": runs,
        "best_samples_per_s": best,
        "speedup_vs_first": {p: v / blind for p, v in best.items()},
        "config": OmegaConf.to_container(OmegaConf.structured(cfg)),
        "environment": environment(),
    }


def table(r: dict) -> str:
    env = r["environment"]
    c = r["config"]
    lines = [
        f"# Speed-aware vs speed-blind on {c['cluster']['name']} ({env['date']}, torch "
        f"{env['torch']}, torchrec {env['torchrec']}; {' '.join(c['overrides'])}, "
        f"{c['steps']} steps, best of {c['repeats']})",
        "",
        f"| planner | batch per rank | samples/s | vs {c['planners'][0]} |",
        "|---|---|---|---|",
    ]
    for p, v in r["best_samples_per_s"].items():
        shares = r["runs"][p][0]["batch_per_rank"]
        lines.append(f"| {p} | {shares} | {v:,.0f} | {r['speedup_vs_first'][p]:.2f}x |")
    return "\n".join(lines)


register_configs()  # the cluster group's schema
ConfigStore.instance().store(name="base_bench_speed_aware", node=SpeedAwareBenchConfig)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="bench_speed_aware")
@benchmark_command
def main(cfg: DictConfig) -> None:
    typed: SpeedAwareBenchConfig = start(cfg)
    result = run(typed)
    finish(result, table(result), "speed_aware", typed)


if __name__ == "__main__":
    from recsys.launch import serve_forks_from_here

    serve_forks_from_here()  # its ranks start from the stack this process imported
    main()
