"""`python -m benchmarks.scale`: plans and simulated training steps from 8 to 1,536 workers.

For each cluster family (`families`: homogeneous 8 x H100 nodes, or hetero_64's mix of
nodes repeated) and size, each planner plans the model's tables; for each schedule
(`plain`, `sparse_dist`, `semi_sync`, `nested<N>`) the step simulator
(`sharding.simulate`) runs the plan's per-rank stage times, from the cost model, on the
resources each stage uses, and reports the step time, the exposed communication, the
scaling efficiency (throughput per worker against the family's smallest cluster) and the
memory headroom. `oversubscription` divides the inter-node bandwidth.

Before any of that, `validation` checks the simulator where a check is possible: fed the
calibrated CPU constants, it predicts the step times measured on local ranks, across a
shaped link and on the emulated mixed cluster (the settings and measurements in
`benchmarks/results/calibrate/` and `pipeline_emu_mixed4/`), error per setting.

Writes summary.json (`points`: `family`, `workers`, `schedule`, `planner`, `step_ms`,
`exposed_comm_ms`, `scaling_efficiency`, `headroom`; `validation`: `setting`,
`predicted_ms`, `measured_ms`, `rel_error`), scale.md, scaling.png and timeline.png (one
step of `timeline_workers` workers, a few ranks).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from benchmarks.common import environment, finish, start

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
FAMILY_BASE = {"homogeneous": ("2x8_h100", 8), "mixed": ("hetero_64", 64)}  # preset, unit


@dataclass
class ScaleConfig:
    families: list[str] = field(default_factory=lambda: ["homogeneous", "mixed"])
    workers: list[int] = field(default_factory=lambda: [8, 16, 32, 64, 128, 256, 512, 1024, 1536])
    planners: list[str] = field(default_factory=lambda: ["hybrid", "round_robin", "torchrec"])
    torchrec_max_workers: int = 64  # TorchRec's own planner is slow past this; skipped above
    schedules: list[str] = field(
        default_factory=lambda: [
            "plain",
            "sparse_dist",
            "semi_sync",
            "nested2",
            "nested4",
            "nested8",
        ]
    )
    model: str = "dcnv2_mlperf"
    batch_per_worker: int = 4096
    oversubscription: float = 1.0  # the inter-node bandwidth divided by this
    allreduce: str = "nccl"  # the families' network.allreduce: NCCL picks ring or tree
    timeline_workers: int = 64
    validation: bool = True
    save: bool = False  # also write benchmarks/results/ (see common.output_dirs)
    results_dir: str = str(RESULTS / "scale")


def _compose(overrides: list[str]):
    from recsys.train import to_typed

    return to_typed(hydra.compose(config_name="config", overrides=overrides))


def cluster_at(family: str, workers: int, oversubscription: float, allreduce: str = "nccl"):
    """The family's cluster with `workers` devices: its base preset's nodes repeated."""
    preset, unit = FAMILY_BASE[family]
    if workers % unit:
        return None
    base = _compose([f"cluster={preset}"]).cluster
    factor = workers // unit
    nodes = [replace(n, count=n.count * factor) for n in base.nodes]
    if family == "homogeneous":
        nodes = [replace(base.nodes[0], count=workers // 8)]
    net = replace(base.network, inter_node_gbps=base.network.inter_node_gbps / oversubscription,
                  allreduce=allreduce)  # fmt: skip
    return replace(base, name=f"{family}_{workers}", nodes=nodes, network=net)


def schedule_of_label(label: str):
    """A schedule label -> (cost-model schedule, micro-batches, stale): `nested<N>`,
    `semi_sync` (SparseDist's ids ahead, and the next batch's embeddings: stale), or a
    schedule's name."""
    from sharding.cost_model import Schedule

    if label.startswith("nested"):
        return Schedule.nested, int(label[len("nested") :] or 4), False
    if label == "semi_sync":
        return Schedule.sparse_dist, 1, True
    return Schedule(label), 1, False


def scale_points(cfg: ScaleConfig) -> tuple[list[dict], dict]:
    """Every (family, size, planner, schedule) point, and the plans' timelines source."""
    from recsys.planning import make_plan, plan_inputs
    from sharding.plan_eval import plan_cost
    from sharding.simulate import simulate

    points, keep = [], {}
    # the timeline's size: the largest one simulated up to timeline_workers
    shown = max((w for w in cfg.workers if w <= cfg.timeline_workers), default=min(cfg.workers))
    for family in cfg.families:
        for workers in cfg.workers:
            spec = cluster_at(family, workers, cfg.oversubscription, cfg.allreduce)
            if spec is None:
                continue
            for planner in cfg.planners:
                if planner == "torchrec" and workers > cfg.torchrec_max_workers:
                    continue
                tcfg = _compose([f"model={cfg.model}", f"planner={planner}",
                                 f"trainer.batch_size={cfg.batch_per_worker}"])  # fmt: skip
                tcfg = replace(tcfg, cluster=spec)
                t0 = time.perf_counter()
                inputs = plan_inputs(tcfg, None, None)
                plan = make_plan(tcfg, inputs)
                planning_s = time.perf_counter() - t0
                cost = plan_cost(plan, inputs)
                headroom = min(1 - d["hbm_used_bytes"] / max(d["hbm_cap_bytes"], 1)
                               for d in plan.devices)  # fmt: skip
                for label in cfg.schedules:
                    schedule, n, stale = schedule_of_label(label)
                    sim = simulate(cost, schedule, n, stale=stale)
                    points.append({
                        "family": family, "workers": workers, "planner": planner,
                        "schedule": label, "step_ms": 1000 * sim.step_s,
                        "exposed_comm_ms": 1000 * sim.exposed_comm_s,
                        "closed_form_ms": 1000 * cost.step_s(schedule, n),
                        "samples_per_s": sum(plan.batch_per_rank) / sim.step_s,
                        "headroom": headroom, "feasible": plan.feasible,
                        "planning_s": planning_s,
                    })  # fmt: skip
                    if workers == shown and planner == cfg.planners[0]:
                        keep[(family, label)] = sim
                print(f"{family} {workers:>5} workers, {planner}: planned in {planning_s:.1f} s",
                      flush=True)  # fmt: skip
    for p in points:  # throughput per worker against the family's smallest size
        base = min((q for q in points if q["family"] == p["family"]
                    and q["planner"] == p["planner"] and q["schedule"] == p["schedule"]),
                   key=lambda q: q["workers"])  # fmt: skip
        per_worker = p["samples_per_s"] / p["workers"]
        p["scaling_efficiency"] = per_worker / (base["samples_per_s"] / base["workers"])
    return points, keep


def validation_settings() -> list[dict]:
    """Measured settings whose config is known: the calibration's validation runs and the
    pipeline benchmark on the emulated mixed cluster."""
    out = []
    cal = json.loads((RESULTS / "calibrate" / "summary.json").read_text())
    for v in cal["validation"]:
        out.append({"setting": v["setting"], "overrides": v["overrides"], "link": v["link"],
                    "measured_ms": v["measured_ms"]})  # fmt: skip
    emu = json.loads((RESULTS / "pipeline_emu_mixed4" / "summary.json").read_text())
    c = emu["config"]
    for row in emu["rows"]:
        label = row["pipeline"]
        if "+" in label:  # dedup: the cost model does not price it
            continue
        from benchmarks.pipeline import pipeline_overrides

        overrides = ["cluster=emu_mixed4", *c["overrides"], *pipeline_overrides(label)]
        out.append({"setting": f"emu_mixed4 {label}", "overrides": overrides,
                    "link": "emu_mixed4", "measured_ms": row["step_ms"]})  # fmt: skip
    return out


def validate() -> list[dict]:
    from recsys.planning import make_plan, plan_inputs
    from sharding.cost_model import schedule_of
    from sharding.plan_eval import plan_cost
    from sharding.simulate import simulate

    rows = []
    for s in validation_settings():
        tcfg = _compose(s["overrides"])
        inputs = plan_inputs(tcfg, None, s["link"])
        plan = make_plan(tcfg, inputs)
        cost = plan_cost(plan, inputs)
        schedule = schedule_of(tcfg.pipeline.name.value)
        if tcfg.pipeline.name.value == "semi_sync":
            sim = simulate(cost, *schedule_of_label("semi_sync")[:2], stale=True)
        else:
            sim = simulate(cost, schedule, tcfg.pipeline.micro_batches)
        predicted = 1000 * sim.step_s
        rows.append({**s, "predicted_ms": predicted,
                     "closed_form_ms": 1000 * cost.step_s(schedule, tcfg.pipeline.micro_batches),
                     "rel_error": (predicted - s["measured_ms"]) / s["measured_ms"]})  # fmt: skip
    return rows


def plot_scaling(points: list[dict], path: Path) -> None:
    from benchmarks.plots import _plt

    plt = _plt()
    families = sorted({p["family"] for p in points})
    fig, axes = plt.subplots(1, len(families), figsize=(6.5 * len(families), 4.5), squeeze=False)
    schedules = sorted({p["schedule"] for p in points})
    color = dict(zip(schedules, plt.get_cmap("tab10").colors, strict=False))
    style = {"hybrid": "-", "torchrec": ":", "round_robin": "--", "greedy_size": "-."}
    for ax, family in zip(axes[0], families, strict=True):
        for planner in sorted({p["planner"] for p in points}):
            for schedule in schedules:
                pts = sorted((p for p in points if p["family"] == family and
                              p["planner"] == planner and p["schedule"] == schedule),
                             key=lambda p: p["workers"])  # fmt: skip
                if pts:
                    ax.plot([p["workers"] for p in pts], [p["scaling_efficiency"] for p in pts],
                            marker="o", ms=3, lw=1.4 if planner == "hybrid" else 0.9,
                            ls=style.get(planner, "-"), color=color[schedule],
                            label=f"{planner}, {schedule}")  # fmt: skip
        sizes = sorted({p["workers"] for p in points if p["family"] == family})
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(w) for w in sizes], fontsize=7)
        ax.set_xlabel("workers")
        ax.set_ylabel("throughput per worker / the smallest size's")
        ax.set_title(f"{family} family (simulated)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    fig.suptitle("Scaling efficiency; colour: schedule, line: planner (solid hybrid, dotted "
                 "torchrec, dashed round_robin)", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timeline(sims: dict, path: Path, ranks: int = 4) -> None:
    """One steady-state step per schedule: each of a few ranks' compute and network queue."""
    from benchmarks.plots import _plt

    plt = _plt()
    colors = {"lookup": "tab:blue", "dense": "tab:green", "emb": "tab:orange",
              "grad": "tab:red", "ids": "tab:purple", "allreduce": "tab:brown",
              "update": "tab:gray"}  # fmt: skip
    names = {"emb": "embedding chunks", "grad": "gradient chunks",
             "update": "lookup backward, update, overheads"}  # fmt: skip
    fig, axes = plt.subplots(len(sims), 1, figsize=(11, 1.6 + 1.1 * len(sims)), squeeze=False)
    for ax, ((family, label), sim) in zip(axes[:, 0], sims.items(), strict=True):
        t, k = sim.timeline, sim.last_step
        t0 = t.end(f"s{k - 1}:done")
        rows = []
        for name, (a, b) in t.spans.items():
            step, _, rest = name.partition(":")
            if "@" not in rest or step not in (f"s{k}", f"s{k + 1}") or b <= t0:
                continue
            kind, rank = rest.split("@")
            if int(rank) >= ranks:
                continue
            lane = f"rank {rank} {'net' if t.resources[name].startswith('net') else 'compute'}"
            base = kind.rstrip("0123456789")
            rows.append((lane, a - t0, b - a, colors.get(base, "k")))
        lanes = sorted({r[0] for r in rows})
        for lane, a, w, c in rows:
            ax.barh(lanes.index(lane), w * 1e3, left=a * 1e3, color=c, edgecolor="white", lw=0.3)
        ax.set_yticks(range(len(lanes)), lanes, fontsize=6)
        ax.set_title(f"{family}, {label}: one step, {sim.step_s * 1e3:.1f} ms", fontsize=8)
        ax.axvline(sim.step_s * 1e3, color="k", lw=0.8)
    axes[-1, 0].set_xlabel("ms from the previous step's end")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, [names.get(k, k) for k in colors], fontsize=7, ncol=len(colors),
               loc="lower center")  # fmt: skip
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(result: dict) -> str:
    c = result["config"]
    lines = [f"# Scale study (simulated; {result['environment']['date']}, model {c['model']}, "
             f"batch {c['batch_per_worker']} per worker, oversubscription "
             f"{c['oversubscription']:g})", ""]  # fmt: skip
    v = result.get("validation")
    if v:
        lines += ["| measured setting | simulated ms | closed form ms | measured ms | error |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for r in v:
            lines.append(f"| {r['setting']} | {r['predicted_ms']:.1f} | {r['closed_form_ms']:.1f} "
                         f"| {r['measured_ms']:.1f} | {r['rel_error']:+.0%} |")  # fmt: skip
        lines += ["", f"Simulator: median absolute error {result['median_abs_error']:.1%}, worst "
                  f"{result['worst_setting']}.", ""]  # fmt: skip
    lines += ["| family | workers | planner | schedule | step ms | exposed comm ms | scaling "
              "efficiency | headroom |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for p in result["points"]:
        lines.append(f"| {p['family']} | {p['workers']} | {p['planner']} | {p['schedule']} | "
                     f"{p['step_ms']:.2f} | {p['exposed_comm_ms']:.2f} | "
                     f"{p['scaling_efficiency']:.0%} | {p['headroom']:.0%} |")  # fmt: skip
    return "\n".join(lines)


ConfigStore.instance().store(name="base_bench_scale", node=ScaleConfig)


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench_scale")
def main(cfg: DictConfig) -> None:
    from benchmarks.common import output_dirs
    from recsys.config import register_configs

    register_configs()
    typed: ScaleConfig = start(cfg)
    t0 = time.perf_counter()
    result: dict = {"config": OmegaConf.to_container(cfg), "environment": environment()}
    if typed.validation:
        v = validate()
        result["validation"] = v
        result["median_abs_error"] = statistics.median(abs(r["rel_error"]) for r in v)
        result["worst_setting"] = max(v, key=lambda r: abs(r["rel_error"]))["setting"]
    result["points"], sims = scale_points(typed)
    result["elapsed_s"] = time.perf_counter() - t0
    finish(result, table(result), "scale", typed, json_name="summary")
    for d in output_dirs(typed):
        plot_scaling(result["points"], d / "scaling.png")
        if sims:
            plot_timeline(sims, d / "timeline.png")


if __name__ == "__main__":
    main()
