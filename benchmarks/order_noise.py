"""`python -m benchmarks.order_noise`: how far a training run drifts from floating-point
reordering alone, beside the nested pipeline's distance from the plain loop.

Three runs of the same config from the same seed on 2 local ranks: the plain loop; the
plain loop with the samples of every batch in a random order (the same mean loss, summed in
another order); and the nested pipeline. If the reordered plain loop drifts, the run
amplifies rounding, and no pipeline can be compared with the plain loop step for step on
it beyond that point.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from benchmarks.common import benchmark_command, environment, finish, start
from recsys import CONF_DIR

REPO = Path(__file__).resolve().parents[1]


@dataclass
class OrderNoiseConfig:
    overrides: list[str] = field(
        default_factory=lambda: ["trainer.batch_size=2048", "planner=greedy_size"]
    )
    steps: int = 20
    micro_batches: int = 4
    nested_overrides: list[str] = field(default_factory=list)  # e.g. [pipeline.dedup=true]
    tolerance: float = 1e-5
    save: bool = False  # also write benchmarks/results/ (see common.output_dirs)
    results_dir: str = str(REPO / "benchmarks" / "results" / "order_noise")


def _rank(cfgs: list, plan, steps: int, run_dir: str) -> list[list[float]]:
    """On each rank: the plain loop, the plain loop with shuffled samples, nested."""
    import torch

    from pipelines.clustering import permute_batch
    from recsys.app.planning import run_context
    from recsys.app.train import quiet_library_noise
    from recsys.trainer.loop import train_each

    quiet_library_noise()
    gen = torch.Generator().manual_seed(1)

    def shuffle(b):
        return permute_batch(b, torch.randperm(len(b.labels), generator=gen))

    plain, nested = run_context(cfgs[0], plan), run_context(cfgs[1], plan)
    runs = [(plain, None), (plain, shuffle), (nested, None)]
    return [losses for _, losses in train_each(runs, steps, run_dir)]


def run(cfg: OrderNoiseConfig, run_dir: Path) -> dict:
    from recsys.app.planning import make_plan, plan_inputs
    from recsys.app.train import to_typed
    from recsys.launch import raise_on_failure, spawn_ranks
    from sharding.types import PlannerName

    nested = [
        "pipeline=nested",
        f"pipeline.micro_batches={cfg.micro_batches}",
        *cfg.nested_overrides,
    ]
    cfgs = [
        to_typed(hydra.compose(config_name="config", overrides=cfg.overrides + extra))
        for extra in ([], nested)
    ]
    plan = None
    if cfgs[0].planner.name != PlannerName.torchrec:
        plan = make_plan(cfgs[0], plan_inputs(cfgs[0], None, None))
    job = spawn_ranks(_rank, 2, args=(cfgs, plan, cfg.steps, str(run_dir)), timeout_s=1800)
    plain, shuffled, nest = raise_on_failure(job, "order noise")[0]

    def rel(other: list[float]) -> list[float]:
        return [abs(a - b) / abs(a) for a, b in zip(plain, other, strict=True)]

    def first_over(diffs: list[float]) -> int | None:
        return next((i + 1 for i, d in enumerate(diffs) if d > cfg.tolerance), None)

    rows = [
        {"step": i + 1, "loss": plain[i], "shuffled": s, "nested": n}
        for i, (s, n) in enumerate(zip(rel(shuffled), rel(nest), strict=True))
    ]
    return {
        "rows": rows,
        "max_rel_diff": {
            "shuffled": max(r["shuffled"] for r in rows),
            "nested": max(r["nested"] for r in rows),
        },
        "first_step_over_tolerance": {
            "shuffled": first_over(rel(shuffled)),
            "nested": first_over(rel(nest)),
        },
        "config": OmegaConf.to_container(OmegaConf.structured(cfg)),
        "environment": environment(),
    }


def table(r: dict) -> str:
    c, env = r["config"], r["environment"]
    lines = [
        f"# Rounding noise of a run: plain vs plain with shuffled samples vs nested "
        f"N={c['micro_batches']} {' '.join(c['nested_overrides'])} ({env['date']}, "
        f"torch {env['torch']}, torchrec {env['torchrec']}; {' '.join(c['overrides'])})",
        "",
        "Relative loss difference from the plain loop, per step:",
        "",
        "| step | plain loss | shuffled samples | nested |",
        "|---|---|---|---|",
    ]
    for x in r["rows"]:
        lines.append(f"| {x['step']} | {x['loss']:.6f} | {x['shuffled']:.1e} | {x['nested']:.1e} |")
    first = r["first_step_over_tolerance"]
    lines += [
        "",
        f"First step over {c['tolerance']:g}: shuffled {first['shuffled']}, "
        f"nested {first['nested']} (None: never).",
    ]
    return "\n".join(lines)


ConfigStore.instance().store(name="base_bench_order_noise", node=OrderNoiseConfig)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="bench_order_noise")
@benchmark_command
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    typed: OrderNoiseConfig = start(cfg)
    result = run(typed, Path(HydraConfig.get().runtime.output_dir))
    finish(result, table(result), "order_noise", typed)


if __name__ == "__main__":
    from recsys.launch import serve_forks_from_here

    serve_forks_from_here()  # its ranks start from the stack this process imported
    main()
