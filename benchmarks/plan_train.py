"""`python -m benchmarks.plan_train`: plans trained for real across a rate-limited link.

Two ranks in two network namespaces joined by a veth pair limited by tbf (`link_rate`).
For each planner: two training runs of different lengths; the link's byte counters give
the bytes each training step sends (the difference of the two runs over the difference of
their steps, so start-up, planning and evaluation traffic cancel out), and the longer run,
repeated `repeats` times interleaved across planners, gives samples/s (the best run's,
every run listed). Beside them, the cost model's prediction for each plan. Needs root.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from benchmarks import netns
from benchmarks.calibrate import measured_ms
from benchmarks.common import environment, finish, planner_overrides, start

REPO = Path(__file__).resolve().parents[1]


@dataclass
class PlanTrainBenchConfig:
    # "+pooled": the hybrid plan with TorchRec's pooled exchange for its cold parts
    planners: list[str] = field(default_factory=lambda: ["torchrec", "hybrid+pooled", "hybrid"])
    overrides: list[str] = field(default_factory=lambda: ["trainer.batch_size=2048"])
    steps: list[int] = field(default_factory=lambda: [20, 80])
    repeats: int = 3  # long runs per planner, interleaved; the best samples/s is reported
    link_rate: str = "1gbit"
    results_dir: str = str(REPO / "benchmarks" / "results" / "plan_train")


def run(cfg: PlanTrainBenchConfig) -> dict:
    why_not = netns.available()
    if why_not:
        raise SystemExit(f"benchmarks.plan_train {why_not}")
    from recsys.planning import make_plan, plan_inputs
    from recsys.train import to_typed

    short, long = cfg.steps
    runs: dict[str, list[tuple[float, dict]]] = {p: [] for p in cfg.planners}
    short_bytes: dict[str, float] = {}
    with netns.veth_link(cfg.link_rate) as link, tempfile.TemporaryDirectory() as tmp:
        for rep in range(cfg.repeats):  # interleaved, so drift on the machine hits all alike
            for planner in cfg.planners:
                # the planner plans for the link the ranks train across
                overrides = [*planner_overrides(planner), *cfg.overrides,
                             f"planner.link=veth_{cfg.link_rate}"]  # fmt: skip
                if rep == 0:
                    short_bytes[planner], _ = netns.train_pair(
                        link, overrides, short, Path(tmp) / f"{planner}_short"
                    )
                b_long, summary = netns.train_pair(
                    link, overrides, long, Path(tmp) / f"{planner}_long{rep}"
                )
                runs[planner].append((b_long, summary))
                print(f"run {rep + 1}/{cfg.repeats} {planner}: "
                      f"{summary['samples_per_s']:,.0f} samples/s", flush=True)  # fmt: skip
    rows = []
    for planner in cfg.planners:
        overrides = [*planner_overrides(planner), *cfg.overrides,
                     f"planner.link=veth_{cfg.link_rate}"]  # fmt: skip
        typed = to_typed(hydra.compose(config_name="plan", overrides=overrides))
        plan = make_plan(typed, plan_inputs(typed, None, None))
        b_long, best = max(runs[planner], key=lambda run: run[1]["samples_per_s"])
        rows.append({"planner": planner,
                     "bytes_per_step": (b_long - short_bytes[planner]) / (long - short),
                     "samples_per_s": best["samples_per_s"],
                     "samples_per_s_runs": [r[1]["samples_per_s"] for r in runs[planner]],
                     "predicted_a2a_bytes_per_step": plan.a2a_bytes_per_step,
                     "predicted_step_ms": plan.est_step_ms,
                     "measured_step_ms": measured_ms(best)})  # fmt: skip
    base = rows[0]
    for r in rows:
        r["bytes_vs_first"] = r["bytes_per_step"] / base["bytes_per_step"]
        r["speedup_vs_first"] = r["samples_per_s"] / base["samples_per_s"]
    return {"rows": rows, "config": OmegaConf.to_container(OmegaConf.structured(cfg)),
            "environment": environment()}  # fmt: skip


def table(r: dict) -> str:
    env = r["environment"]
    first = r["rows"][0]["planner"]
    lines = [f"# Plans trained across a {r['config']['link_rate']} veth link, 2 ranks "
             f"({env['date']}, torch {env['torch']}, torchrec {env['torchrec']}; "
             f"{' '.join(r['config']['overrides'])}; samples/s: best of "
             f"{r['config']['repeats']} interleaved runs)", "",
             f"| planner | link bytes/step (measured) | vs {first} | samples/s (measured) | "
             f"speedup vs {first} | every run's samples/s | predicted a2a bytes/step | "
             f"predicted / measured ms |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for x in r["rows"]:
        predicted_mb = x["predicted_a2a_bytes_per_step"] / 1e6
        each = ", ".join(f"{v:,.0f}" for v in x.get("samples_per_s_runs", []))
        lines.append(f"| {x['planner']} | {x['bytes_per_step'] / 1e6:.2f} MB | "
                     f"{x['bytes_vs_first']:.2f}x | {x['samples_per_s']:,.0f} | "
                     f"{x['speedup_vs_first']:.2f}x | {each} | {predicted_mb:.2f} MB | "
                     f"{x['predicted_step_ms']:.1f} / {x['measured_step_ms']:.1f} |")  # fmt: skip
    return "\n".join(lines)


ConfigStore.instance().store(name="base_bench_plan_train", node=PlanTrainBenchConfig)


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench_plan_train")
def main(cfg: DictConfig) -> None:
    typed: PlanTrainBenchConfig = start(cfg)
    result = run(typed)
    finish(result, table(result), "plan_train", typed.results_dir)


if __name__ == "__main__":
    main()
