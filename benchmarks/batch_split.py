"""`python -m benchmarks.batch_split cluster=emu_mixed3`: hybrid's plan trained at its own
speed-aware batch split and at splits that move samples from the slower ranks to the
fastest ones (or back), beside TorchRec's plan, each predicted by the cost model.

The tables stay where hybrid put them; only the batch split changes (`split_with`: each
slower rank gives `shift` of its samples, shared evenly by the fastest ranks; a negative
shift moves them the other way), each trained as a saved plan (`trainer.plan`). The runs
interleave, `repeats` of each, so drift on the machine hits all alike. It checks what the
planner's choice of split rests on: whether the split the cost model finds best is the one
that trains fastest. Any cluster whose ranks differ in speed: an emulated preset as root
(`emu_mixed3`, `emu_mixed4`), or `local_cpu3_skewed`.
"""

from __future__ import annotations

import copy
import json
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from benchmarks import plots
from benchmarks.calibrate import measured_ms
from benchmarks.common import benchmark_command, environment, finish, results_dir_for, start
from recsys import CONF_DIR
from recsys.config import register_configs
from sharding.types import ClusterSpec

OURS = "hybrid's"  # the row of hybrid's own split


@dataclass
class BatchSplitBenchConfig:
    cluster: ClusterSpec = field(default_factory=ClusterSpec)  # the group: emu_mixed3
    overrides: list[str] = field(default_factory=lambda: ["trainer.batch_size=2048"])
    # each: the share of every slower rank's samples moved to the fastest ranks
    shifts: list[float] = field(default_factory=lambda: [-0.15, 0.15, 0.3, 0.45])
    baseline: str | None = "torchrec"  # a planner whose own plan trains beside (None: none)
    steps: int = 60
    repeats: int = 2
    save: bool = False  # also write benchmarks/results/ (see common.output_dirs)
    results_dir: str = ""  # "": benchmarks/results/batch_split_<preset>


def split_with(batch: list[int], speeds: list[float], shift: float) -> list[int]:
    """`batch` with `shift` of each slower rank's samples (core speed below the fastest's)
    moved to the fastest ranks, shared evenly (the remainder to the first); negative: the
    fastest ranks give that share of the slower ranks' samples back. Every rank keeps at
    least one sample, and the global batch stays."""
    fast = [r for r, s in enumerate(speeds) if s == max(speeds)]
    slow = [r for r in range(len(batch)) if r not in fast]
    if not slow:
        raise ValueError(
            "every rank is as fast as the fastest: no batch split to move "
            "(use a cluster whose ranks differ in speed)"
        )
    out = list(batch)
    moved = 0
    for r in slow:
        give = min(round(shift * batch[r]), batch[r] - 1)
        out[r] -= give
        moved += give
    each, rest = divmod(moved, len(fast))
    for i, r in enumerate(fast):
        out[r] += each + (rest if i == 0 else 0)
    if min(out) < 1:
        raise ValueError(f"shift {shift} leaves a rank no samples: {out}")
    return out


def run(cfg: BatchSplitBenchConfig) -> dict:
    from recsys.app.planning import make_plan, plan_inputs, plan_json
    from recsys.app.train import to_typed, train
    from sharding.plan_eval import evaluate

    where = [f"cluster={cfg.cluster.name}", *cfg.overrides]
    every = ["planner=hybrid", "planner.leave_out=false"]  # the split over every rank
    typed = to_typed(hydra.compose(config_name="config", overrides=[*where, *every]))
    inputs = plan_inputs(typed, None, None)
    plan = make_plan(typed, inputs)
    speeds = [d.core_speed for d in inputs.devices]
    splits = {OURS: plan.batch_per_rank}
    try:
        for shift in cfg.shifts:
            splits[f"{shift:+.2f}"] = split_with(plan.batch_per_rank, speeds, shift)
    except ValueError as e:
        raise SystemExit(f"benchmarks.batch_split cluster={cfg.cluster.name}: {e}") from None
    rows: dict[str, dict] = {}
    common = [
        *where,
        f"trainer.max_steps={cfg.steps}",
        "trainer.progress_bar=false",
        "dataset.eval_batches=1",
        "trainer.warmup_steps=5",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        runs: dict[str, list[str]] = {}
        if cfg.baseline:  # its own plan, as TorchRec's planner makes it in the ranks
            choice = [*where, f"planner={cfg.baseline}"]
            base = to_typed(hydra.compose(config_name="config", overrides=choice))
            rows[cfg.baseline] = {
                "batch_per_rank": [base.trainer.batch_size] * inputs.world,
                "predicted_ms": make_plan(base, plan_inputs(base, None, None)).est_step_ms,
            }
            runs[cfg.baseline] = [*common, f"planner={cfg.baseline}"]
        for name, batch in splits.items():
            moved = copy.deepcopy(plan)
            moved.batch_per_rank, moved.devices = batch, []
            moved = evaluate(moved, inputs)
            path = Path(tmp) / f"plan_{len(runs)}.json"
            path.write_text(json.dumps(plan_json(moved)))
            rows[name] = {"batch_per_rank": batch, "predicted_ms": moved.est_step_ms}
            runs[name] = [*common, "planner=hybrid", f"trainer.plan={path}"]
        for rep in range(cfg.repeats):  # interleaved
            for name, overrides in runs.items():
                summary = train(
                    hydra.compose(config_name="config", overrides=overrides),
                    Path(tmp) / f"run{list(runs).index(name)}_{rep}",
                )
                rows[name].setdefault("runs", []).append(measured_ms(summary))
                print(
                    f"run {rep + 1}/{cfg.repeats} {name} {rows[name]['batch_per_rank']}: "
                    f"{rows[name]['runs'][-1]:.1f} ms a step",
                    flush=True,
                )
    for row in rows.values():
        row["measured_ms"] = statistics.median(row["runs"])
        row["error"] = row["predicted_ms"] / row["measured_ms"] - 1
    ours = rows[OURS]
    best_measured = min((n for n in splits), key=lambda n: rows[n]["measured_ms"])
    best_predicted = min((n for n in splits), key=lambda n: rows[n]["predicted_ms"])
    return {
        "rows": [{"split": name, **row} for name, row in rows.items()],
        "best_measured": best_measured,
        "best_predicted": best_predicted,
        "best_vs_hybrids": ours["measured_ms"] / rows[best_measured]["measured_ms"],
        "median_abs_error": statistics.median(abs(r["error"]) for r in rows.values()),
        "config": OmegaConf.to_container(OmegaConf.structured(cfg)),
        "environment": environment(),
    }


def table(r: dict) -> str:
    env, c = r["environment"], r["config"]
    ours = next(x["measured_ms"] for x in r["rows"] if x["split"] == OURS)
    lines = [
        f"# Hybrid's plan at several batch splits on {c['cluster']['name']} ({env['date']}, "
        f"torch {env['torch']}, torchrec {env['torchrec']}; {' '.join(c['overrides'])}, "
        f"{c['steps']} steps, {c['repeats']} interleaved runs each, their median)",
        "",
        "| split | batch per rank | predicted ms | measured ms (each run) | error | "
        "hybrid's split / this |",
        "|---|---|---|---|---|---|",
    ]
    for x in r["rows"]:
        each = ", ".join(f"{v:.1f}" for v in x["runs"])
        lines.append(
            f"| {x['split']} | {x['batch_per_rank']} | {x['predicted_ms']:.1f} | "
            f"{x['measured_ms']:.1f} ({each}) | {100 * x['error']:+.0f}% | "
            f"{ours / x['measured_ms']:.2f}x |"
        )
    lines += [
        "",
        f"Fastest measured: {r['best_measured']}; fastest predicted: "
        f"{r['best_predicted']}; hybrid's split steps {r['best_vs_hybrids']:.2f}x the "
        f"fastest measured one's time. Median absolute error "
        f"{100 * r['median_abs_error']:.1f}%.",
    ]
    return "\n".join(lines)


register_configs()  # the cluster group's schema
ConfigStore.instance().store(name="base_bench_batch_split", node=BatchSplitBenchConfig)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="bench_batch_split")
@benchmark_command
def main(cfg: DictConfig) -> None:
    typed: BatchSplitBenchConfig = start(cfg)
    typed.results_dir = typed.results_dir or results_dir_for("batch_split", typed.cluster)
    result = run(typed)
    finish(
        result,
        table(result),
        "batch_split",
        typed,
        json_name="summary",
        picture=(plots.batch_split, "batch_split.png"),
    )


if __name__ == "__main__":
    from recsys.launch import serve_forks_from_here

    serve_forks_from_here()  # its ranks start from the stack this process imported
    main()
