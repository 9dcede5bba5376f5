"""`python -m benchmarks.plan_train`: plans trained for real across a rate-limited link.

Two ranks in two network namespaces joined by a veth pair limited by tbf (`link_rate`), or,
with `cluster=<emulated preset>` (emu_mixed4), every rank of that emulated mixed cluster
(recsys/emulation.py: shares of a core, nodes joined by a shaped link). For each planner:
two training runs of different lengths; the link's byte counters give the bytes each
training step sends (the difference of the two runs over the difference of their steps, so
start-up, planning and evaluation traffic cancel out), and the longer run, repeated
`repeats` times interleaved across planners, gives samples/s (the median run's, with the
range and every run listed). Beside them, the cost model's prediction for each plan.
summary.json has, per planner name, `samples_per_s`, `predicted_ms`, `measured_ms`,
`link_bytes`. Needs root.

Beside the planners, the alternatives that tell a gain's parts apart (`SPLIT_VARIANTS`):
`<planner>+hybrid_split`, that planner's placement at hybrid's batch split (TorchRec's
placement with speed-aware shares), and `<planner>+equal_split`, its placement at equal
batches (hybrid's tables without its split), each trained as a saved plan (`trainer.plan`)
with the same global batch. And the alternatives of leaving devices out: `hybrid+all_devices`
(hybrid kept on every device; not trained where hybrid keeps them all anyway), and with
`parts=[torchrec]` TorchRec's planner on the part of the cluster its plan is predicted
fastest on (`parts_max` of them), the rest left out.
"""

from __future__ import annotations

import copy
import json
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from benchmarks import netns, plots
from benchmarks.calibrate import measured_ms, refresh_calibration
from benchmarks.common import (
    BenchTrainer,
    benchmark_command,
    emulated_preset,
    environment,
    finish,
    planner_overrides,
    results_dir_for,
    start,
    train_emulated,
)
from recsys import CONF_DIR
from recsys.config import register_configs
from sharding.cluster import resolve_cluster
from sharding.errors import UserError
from sharding.subsets import candidates
from sharding.types import ClusterSpec


@dataclass
class PlanTrainBenchConfig:
    # "+pooled": the hybrid plan with TorchRec's pooled exchange for its cold parts;
    # "+2d<G>": the planner's plan for 2D groups of G ranks (pipelines/two_d.py)
    planners: list[str] = field(
        default_factory=lambda: [
            "torchrec",
            "hybrid+pooled",
            "hybrid",
            "greedy_size",
            "round_robin",
        ]
    )
    overrides: list[str] = field(default_factory=lambda: ["trainer.batch_size=2048"])
    steps: list[int] = field(default_factory=lambda: [20, 80])
    repeats: int = 3  # long runs per planner, interleaved; the median samples/s is reported
    link_rate: str = "1gbit"
    # cluster=<an emulated preset> (emu_mixed4): train on it instead of the 2-rank veth pair
    cluster: ClusterSpec | None = None
    # these planners also trained on part of the cluster, as a user might keep it, the other
    # devices left out (whole nodes, the fastest device kinds: sharding.subsets), at the same
    # global batch: rows `<planner>@ranks_<r>_...`
    parts: list[str] = field(default_factory=list)
    parts_max: int = 1  # ... on this many parts, those its plan is predicted fastest on
    # predict with the per-core rates re-measured at the start (about a minute;
    # benchmarks.calibrate.refreshed), not the saved calibration's
    recalibrate: bool = False
    trainer: BenchTrainer = field(default_factory=BenchTrainer)
    save: bool = False  # also write benchmarks/results/ (see common.output_dirs)
    results_dir: str = ""  # "": benchmarks/results/plan_train, plan_train_<preset> with cluster=


# `<planner>+<variant>`: that planner's placement at another batch split (module docstring)
SPLIT_VARIANTS = {"hybrid_split": "at hybrid's batch split", "equal_split": "at equal batches"}


def _moved_plan(cfg: PlanTrainBenchConfig, label: str):
    """The plan of a split variant (`SPLIT_VARIANTS`), priced by the cost model; None for
    any other label."""
    from recsys.app.planning import make_plan, plan_inputs
    from recsys.app.train import to_typed
    from sharding.plan_eval import evaluate

    name, _, variant = label.partition("+")
    if variant not in SPLIT_VARIANTS:
        return None
    every = ["planner.leave_out=false"]  # both on every device
    typed = to_typed(hydra.compose(config_name="plan", overrides=_overrides(cfg, name) + every))
    inputs = plan_inputs(typed, None, None)
    plan = make_plan(typed, inputs)
    total, world = sum(plan.batch_per_rank), len(plan.batch_per_rank)
    if variant == "hybrid_split":
        ours = _overrides(cfg, "hybrid") + every
        hybrid = to_typed(hydra.compose(config_name="plan", overrides=ours))
        batch = make_plan(hybrid, inputs).batch_per_rank
    else:
        batch = [total // world + (r < total % world) for r in range(world)]
    moved = copy.deepcopy(plan)
    moved.batch_per_rank, moved.devices = batch, []
    return evaluate(moved, inputs)


def _overrides(cfg: PlanTrainBenchConfig, planner: str) -> list[str]:
    """The planner plans for the link the ranks train across: the veth pair's calibrated
    link, or the emulated cluster's own (its default); `<planner>@ranks_<r>_...` on those
    ranks alone, each with its share of the same global batch."""
    name = emulated_preset(cfg.cluster, "plan_train")
    where = [f"cluster={name}"] if name else [f"planner.link=veth_{cfg.link_rate}"]
    planner, at, ranks = planner.partition("@")
    if not at:
        return [*planner_overrides(planner), *cfg.overrides, *where]
    from recsys.app.train import to_typed

    keep = [int(r) for r in ranks.removeprefix("ranks_").split("_")]
    whole = to_typed(hydra.compose(config_name="config", overrides=[*cfg.overrides, *where]))
    total = whole.trainer.batch_size * len(resolve_cluster(whole.cluster))
    return [
        *planner_overrides(planner),
        *cfg.overrides,
        *where,
        f"cluster.only_ranks=[{','.join(map(str, keep))}]",
        f"trainer.batch_size={total // len(keep)}",
    ]


def part_labels(cfg: PlanTrainBenchConfig) -> list[str]:
    """`<planner>@ranks_<r>_...` for each planner of `parts` on the `parts_max` parts of the
    cluster its plan is predicted fastest on (parts whose ranks split the global batch
    evenly, that hold the model); each part's prediction printed."""
    from recsys.app.planning import make_plan, plan_inputs
    from recsys.app.train import to_typed

    if not cfg.parts or cfg.cluster is None:
        return []
    world = len(resolve_cluster(cfg.cluster))
    composed = hydra.compose(config_name="config", overrides=cfg.overrides)
    total = world * to_typed(composed).trainer.batch_size
    out = []
    for planner in cfg.parts:
        predicted = []
        for keep, what in candidates(cfg.cluster):
            label = f"{planner}@ranks_{'_'.join(map(str, keep))}"
            if total % len(keep):
                print(f"{label} ({what}): {len(keep)} ranks cannot split {total} samples evenly")
                continue
            typed = to_typed(hydra.compose(config_name="plan", overrides=_overrides(cfg, label)))
            try:
                plan = make_plan(typed, plan_inputs(typed, None, None))
            except UserError as e:
                print(f"{label} ({what}): not trained: {e}")
                continue
            print(f"{label} ({what}): predicted {plan.est_step_ms:.1f} ms/step", flush=True)
            if plan.feasible:
                predicted.append((plan.est_step_ms, label))
        out += [label for _, label in sorted(predicted)[: cfg.parts_max]]
    return out


def _same_as_hybrid(cfg: PlanTrainBenchConfig) -> bool:
    """Whether hybrid keeps every device here (`hybrid+all_devices` would train its plan
    again)."""
    from recsys.app.planning import make_plan, plan_inputs
    from recsys.app.train import to_typed

    typed = to_typed(hydra.compose(config_name="plan", overrides=_overrides(cfg, "hybrid")))
    return not make_plan(typed, plan_inputs(typed, None, None)).left_out


@contextmanager
def trainer_on(cfg: PlanTrainBenchConfig) -> Iterator[Callable[..., tuple[int, dict]]]:
    """`train(overrides, steps, run_dir) -> (link bytes, summary)` on the veth pair or on
    the emulated cluster."""
    if cfg.cluster:
        yield partial(train_emulated, emulated_preset(cfg.cluster, "plan_train"))
        return
    why_not = netns.available()
    if why_not:
        raise SystemExit(f"benchmarks.plan_train {why_not}")
    with netns.veth_link(cfg.link_rate) as link:
        yield partial(netns.train_pair, link)


def run(cfg: PlanTrainBenchConfig) -> dict:
    from recsys.app.planning import make_plan, plan_inputs, plan_json
    from recsys.app.train import to_typed
    from sharding.plan_eval import evaluate
    from sharding.two_d import evaluate_two_d

    short, long = cfg.steps
    if cfg.trainer.max_steps is not None:  # shorter runs: the long one at max_steps
        short, long = max(1, cfg.trainer.max_steps // 4), cfg.trainer.max_steps
    planners = [*cfg.planners, *part_labels(cfg)]  # the config keeps what it was told
    if "hybrid+all_devices" in planners and _same_as_hybrid(cfg):
        print("hybrid keeps every device here: hybrid+all_devices is hybrid, not trained again")
        planners.remove("hybrid+all_devices")
    runs: dict[str, list[tuple[float, dict]]] = {p: [] for p in planners}
    short_bytes: dict[str, float] = {}
    fresh = refresh_calibration() if cfg.recalibrate else None  # the cores' speed today
    moved = {p: m for p in planners if (m := _moved_plan(cfg, p)) is not None}
    with trainer_on(cfg) as train, tempfile.TemporaryDirectory() as tmp:

        def overrides_of(planner: str) -> list[str]:
            if planner not in moved:
                return _overrides(cfg, planner)
            path = Path(tmp) / f"{planner}.json"
            path.write_text(json.dumps(plan_json(moved[planner])))
            return [*_overrides(cfg, "hybrid"), f"trainer.plan={path}"]  # trained as it is

        for rep in range(cfg.repeats):  # interleaved, so drift on the machine hits all alike
            for planner in planners:
                overrides = overrides_of(planner)
                if rep == 0:
                    short_bytes[planner], _ = train(overrides, short, Path(tmp) / f"{planner}_s")
                b_long, summary = train(overrides, long, Path(tmp) / f"{planner}_long{rep}")
                runs[planner].append((b_long, summary))
                print(
                    f"run {rep + 1}/{cfg.repeats} {planner}: "
                    f"{summary['samples_per_s']:,.0f} samples/s",
                    flush=True,
                )
    rows = []
    for planner in planners:
        name = planner.partition("+")[0] if planner in moved else planner
        typed = to_typed(hydra.compose(config_name="plan", overrides=_overrides(cfg, name)))
        plan = moved.get(planner) or make_plan(typed, plan_inputs(typed, None, None))
        saved_ms = plan.est_step_ms  # the plan the runs trained, as the saved rates price it
        if fresh is not None:  # that plan, priced with today's per-core rates
            again = evaluate_two_d if plan.sharding_group_size else evaluate
            plan = again(copy.deepcopy(plan), plan_inputs(typed, None, None, fresh))
        ranked = sorted(runs[planner], key=lambda run: run[1]["samples_per_s"])
        b_long, best = ranked[(len(ranked) - 1) // 2]  # the median run (the lower of two)
        each = [run[1]["samples_per_s"] for run in runs[planner]]
        rows.append(
            {
                "planner": planner,
                "bytes_per_step": (b_long - short_bytes[planner]) / (long - short),
                "link_bytes": b_long,
                "batch_per_rank": best["batch_per_rank"],
                "samples_per_s": best["samples_per_s"],
                "samples_per_s_range": [min(each), max(each)],
                "samples_per_s_runs": each,
                "predicted_a2a_bytes_per_step": plan.a2a_bytes_per_step,
                "predicted_step_ms": plan.est_step_ms,
                "predicted_with_saved_rates_ms": saved_ms,
                "measured_step_ms": measured_ms(best),
            }
        )
    base = rows[0]
    for r in rows:
        r["bytes_vs_first"] = r["bytes_per_step"] / base["bytes_per_step"]
        r["speedup_vs_first"] = r["samples_per_s"] / base["samples_per_s"]
        # the ratio's spread: each run against the first planner's run of the same round
        ratios = [
            a / b for a, b in zip(r["samples_per_s_runs"], base["samples_per_s_runs"], strict=True)
        ]
        r["speedup_vs_first_range"] = [min(ratios), max(ratios)]
    return {
        "rows": rows,
        "hybrid_vs_best_alternative": versus_best_alternative(rows),
        # per planner, the figures every plan benchmark reports (the long run's bytes)
        **{
            r["planner"]: {
                "samples_per_s": r["samples_per_s"],
                "predicted_ms": r["predicted_step_ms"],
                "measured_ms": r["measured_step_ms"],
                "link_bytes": r["link_bytes"],
            }
            for r in rows
        },
        "calibration_refreshed": None if fresh is None else fresh.measured["refreshed"]["vs_saved"],
        "config": OmegaConf.to_container(OmegaConf.structured(cfg)),
        "environment": environment(),
    }


def versus_best_alternative(rows: list[dict], ours: str = "hybrid") -> dict | None:
    """`ours` against the fastest other row (every other way to run the cluster): the ratio
    of the medians, and its range over the rounds, each of ours against the fastest other run
    of the same round. None without `ours` or another row."""
    mine = next((r for r in rows if r["planner"] == ours), None)
    others = [r for r in rows if r["planner"] != ours]
    if mine is None or not others:
        return None
    best = max(others, key=lambda r: r["samples_per_s"])
    rounds = [
        run / max(other["samples_per_s_runs"][i] for other in others)
        for i, run in enumerate(mine["samples_per_s_runs"])
    ]
    return {
        "alternative": best["planner"],
        "speedup": mine["samples_per_s"] / best["samples_per_s"],
        "speedup_range": [min(rounds), max(rounds)],
    }


def table(r: dict) -> str:
    env = r["environment"]
    first = r["rows"][0]["planner"]
    c = r["config"]
    where = (
        f"on the emulated cluster {c['cluster']['name']}"
        if c.get("cluster")
        else f"across a {c['link_rate']} veth link, 2 ranks"
    )
    lines = [
        f"# Plans trained {where} "
        f"({env['date']}, torch {env['torch']}, torchrec {env['torchrec']}; "
        f"{' '.join(r['config']['overrides'])}; samples/s: the median of "
        f"{r['config']['repeats']} interleaved runs; a speed-up's range: each run against the "
        f"first planner's run of its round)",
        "",
        f"| planner | link bytes/step (measured) | vs {first} | samples/s (measured) | "
        f"speedup vs {first} (range) | every run's samples/s | predicted a2a bytes/step | "
        f"predicted / measured ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for x in r["rows"]:
        predicted_mb = x["predicted_a2a_bytes_per_step"] / 1e6
        each = ", ".join(f"{v:,.0f}" for v in x.get("samples_per_s_runs", []))
        lines.append(
            f"| {x['planner']} | {x['bytes_per_step'] / 1e6:.2f} MB | "
            f"{x['bytes_vs_first']:.2f}x | {x['samples_per_s']:,.0f} | "
            f"{x['speedup_vs_first']:.2f}x ({x['speedup_vs_first_range'][0]:.2f}-"
            f"{x['speedup_vs_first_range'][1]:.2f}) | {each} | {predicted_mb:.2f} MB | "
            f"{x['predicted_step_ms']:.1f} / {x['measured_step_ms']:.1f} |"
        )
    if vs := r.get("hybrid_vs_best_alternative"):
        lines += [
            "",
            f"hybrid against the best alternative ({vs['alternative']}): {vs['speedup']:.2f}x "
            f"(each round against that round's fastest other run: "
            f"{vs['speedup_range'][0]:.2f}-{vs['speedup_range'][1]:.2f})",
        ]
    return "\n".join(lines)


register_configs()  # the cluster group's schema
ConfigStore.instance().store(name="base_bench_plan_train", node=PlanTrainBenchConfig)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="bench_plan_train")
@benchmark_command
def main(cfg: DictConfig) -> None:
    typed: PlanTrainBenchConfig = start(cfg)
    typed.results_dir = typed.results_dir or results_dir_for("plan_train", typed.cluster)
    result = run(typed)
    finish(
        result,
        table(result),
        "plan_train",
        typed,
        json_name="summary",
        picture=(plots.plan_train, "plan_train.png"),
    )


if __name__ == "__main__":
    from recsys.launch import serve_forks_from_here

    serve_forks_from_here()  # its ranks start from the stack this process imported
    main()
