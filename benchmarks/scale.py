"""`python -m benchmarks.scale`: plans and simulated training steps from 8 to 1,536 workers.

For each cluster family (`families`, a config group in conf/families/: homogeneous 8 x
H100 nodes, or hetero_64's mix of nodes repeated; a family names its preset and the step
its sizes come in) and size, each planner plans the model's tables; for each schedule
(`plain`, `sparse_dist`, `semi_sync`, `nested<N>`) the step simulator
(`sharding.simulate`) runs the plan's per-rank stage times, from the cost model, on the
resources each stage uses, and reports the step time, the exposed communication, the
scaling efficiency (throughput per worker against the family's smallest cluster) and the
memory headroom. `oversubscription` divides the inter-node bandwidth.

Before any of that, `validation` checks the simulator where a check is possible: fed the
calibrated CPU constants, it predicts the step times measured on local ranks, across a
shaped link and on the emulated mixed cluster (the settings and measurements in
`benchmarks/results/calibrate/` and `pipeline_emu_mixed4/`), error per setting; a
calibration setting at the cores' speed measured beside it (the calibration's meter).

Writes summary.json (`points`: `family`, `workers`, `schedule`, `planner`, `step_ms`,
`exposed_comm_ms`, `scaling_efficiency`, `headroom`, `lookup_ms`, `dedup_counts`;
`validation`: `setting`, `cores_speed`, `predicted_ms`, `measured_ms`, `rel_error`),
scale.md, scaling.png and timeline.png (one step of `timeline_workers` workers, a few ranks).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from benchmarks.common import benchmark_command, environment, finish, parse_label, start
from recsys import CONF_DIR

if TYPE_CHECKING:  # the library loads lazily: `--help` and config errors stay fast
    from sharding.access_profile import AccessProfile
    from sharding.distinct import DedupVolume
    from sharding.simulate import SimResult
    from sharding.types import Plan, PlanInputs, StepCost

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


@dataclass
class Family:
    """A cluster family (conf/families/<name>.yaml): the preset's nodes scaled in proportion
    to the size, which must be a multiple of `step` workers."""

    cluster: str  # a conf/cluster preset
    step: int


@dataclass
class ScaleConfig:
    families: dict[str, Family] = field(default_factory=dict)  # bench_scale.yaml's defaults
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
            "nested4+dedup",
            "nested4+dedup+cluster",
        ]
    )
    model: str = "dcnv2_mlperf"
    precision: str = "fp32"  # the dense part's (`trainer.precision`): MLPerf's runs use bf16
    # the model's profile.json (python -m sharding.profile): the planners' coverage curves
    # and dedup's distinct ids per micro-batch; null: the parametric power law (no +cluster)
    profile: str | None = str(RESULTS / "planners" / "profile_mlperf_synthetic.json")
    batch_per_worker: int = 4096
    # each GPU rank's host work per sample to assemble its batch (s). null: this machine's
    # calibrated one-core rate, as the trainer builds a rank's batches in one prefetch
    # thread (at 1.48 us a sample a 4096-sample batch takes 6 ms, longer than every pipelined
    # H100 step to 1,536 workers: it hides what placement and pipelines change); 0: the
    # batch ready, the steps the devices' and the links' alone. The table's heading gives
    # that one-thread floor either way (`host_floor_ms`)
    host_s_per_sample: float | None = 0.0
    oversubscription: float = 1.0  # the inter-node bandwidth divided by this
    allreduce: str = "nccl"  # the families' network.allreduce: NCCL picks ring or tree
    timeline_workers: int = 64
    validation: bool = True
    save: bool = False  # also write benchmarks/results/ (see common.output_dirs)
    results_dir: str = str(RESULTS / "scale")


def _compose(overrides: list[str]):
    from recsys.app.train import to_typed

    return to_typed(hydra.compose(config_name="config", overrides=overrides))


def cluster_at(
    name: str, family: Family, workers: int, oversubscription: float, allreduce: str = "nccl"
):
    """The family's cluster with `workers` devices, None if that is not a multiple of its
    step: each node entry of its preset with its count scaled by workers / the preset's."""
    base = _compose([f"cluster={family.cluster}"]).cluster
    total = sum(n.count * sum(d.count for d in n.devices) for n in base.nodes)
    if family.step < 1 or any(n.count * family.step % total for n in base.nodes):
        raise SystemExit(
            f"benchmarks.scale: family '{name}' (step {family.step}) does not scale "
            f"{family.cluster}'s {total} devices to whole nodes. Fix: families.{name}.step "
            f"such that every node entry's count x step / {total} is a whole number"
        )
    if workers % family.step:
        return None
    nodes = [replace(n, count=n.count * workers // total) for n in base.nodes]
    net = replace(
        base.network,
        inter_node_gbit_s=base.network.inter_node_gbit_s / oversubscription,
        allreduce=allreduce,
    )
    return replace(base, name=f"{name}_{workers}", nodes=nodes, network=net)


def plan_at(
    cfg: ScaleConfig, spec, planner: str, profile: AccessProfile | None
) -> tuple[Plan, PlanInputs, float]:
    """`planner`'s plan of the study's model on the cluster `spec`, `cfg.batch_per_worker`
    samples a worker, what it was planned from, and the seconds planning took."""
    from recsys.app.planning import make_plan, plan_inputs

    tcfg = _compose(
        [
            f"model={cfg.model}",
            f"planner={planner}",
            f"trainer.batch_size={cfg.batch_per_worker}",
            f"trainer.precision={cfg.precision}",
        ]
    )
    # every worker of the family's cluster: the study is of schedules at each size
    tcfg = replace(tcfg, cluster=spec, planner=replace(tcfg.planner, leave_out=False))
    t0 = time.perf_counter()
    inputs = plan_inputs(tcfg, profile, None, profile_path=cfg.profile or "")
    if cfg.host_s_per_sample is not None:
        inputs.devices = [
            replace(d, host_s_per_sample=cfg.host_s_per_sample) for d in inputs.devices
        ]
    plan = make_plan(tcfg, inputs)
    return plan, inputs, time.perf_counter() - t0


@dataclass(frozen=True)
class ScheduleLabel:
    """A schedule label parsed: `plain`, `sparse_dist`, `semi_sync` (SparseDist's ids ahead,
    and the next batch's embeddings: stale) or `nested<N>`, the last with `+dedup` (each
    micro-batch's distinct ids and rows exchanged, `sharding.distinct`) or `+dedup_fwd`
    (distinct rows forward only, gradients pooled) and `+cluster` (key-centric clustering
    first: it changes only what dedup sends)."""

    schedule: Any  # sharding.types.Schedule
    micro_batches: int = 1
    stale: bool = False
    dedup: bool = False
    clustered: bool = False
    dedup_grads: bool = True


def schedule_of_label(label: str) -> ScheduleLabel:
    from sharding.cost_model import schedule_of
    from sharding.types import Schedule

    p = parse_label(label, ("cluster", "dedup", "dedup_fwd"))  # the simulator: no lookahead
    if p.name == "nested":
        return ScheduleLabel(
            Schedule.nested,
            p.micro_batches,
            dedup=p.dedup,
            clustered="cluster" in p.options,
            dedup_grads=p.dedup_grads,
        )
    if p.name == "semi_sync":
        return ScheduleLabel(Schedule.sparse_dist, 1, stale=True)
    return ScheduleLabel(schedule_of(p.name))  # TorchRec's base pipeline runs the plain loop


def simulate_label(
    cost: StepCost,
    label: ScheduleLabel,
    plan: Plan,
    inputs: PlanInputs,
    profile: AccessProfile | None,
) -> tuple[SimResult, StepCost, DedupVolume | None]:
    """The simulated steady state of `cost` under a parsed label, the cost simulated (with
    dedup, its exchange priced by `sharding.distinct` from `profile`) and dedup's volume."""
    from sharding.distinct import dedup_volume, with_dedup
    from sharding.simulate import simulate

    volume = None
    if label.dedup:
        volume = dedup_volume(plan, inputs, label.micro_batches, profile, label.clustered)
        cost = with_dedup(cost, volume, label.dedup_grads)
    return simulate(cost, label.schedule, label.micro_batches, stale=label.stale), cost, volume


def schedules_and_profile(
    cfg: ScaleConfig,
) -> tuple[dict[str, ScheduleLabel], AccessProfile | None]:
    """The parsed schedules and the profile, refused together if a schedule needs counts
    the profile lacks, and the study's other settings checked (one line each, before
    anything is planned)."""
    from recsys.config import Precision
    from sharding.access_profile import AccessProfile

    if cfg.precision not in Precision.__members__:
        raise SystemExit(
            f"benchmarks.scale: precision={cfg.precision} is not one of "
            f"{list(Precision.__members__)} (the dense part's, trainer.precision)"
        )
    if cfg.host_s_per_sample is not None and not cfg.host_s_per_sample >= 0:
        raise SystemExit(
            f"benchmarks.scale: host_s_per_sample={cfg.host_s_per_sample} is not a time. Fix: "
            "seconds a sample, 0 for the batch ready, or null for this machine's calibrated rate"
        )
    try:
        labels = {label: schedule_of_label(label) for label in cfg.schedules}
        profile = AccessProfile.load(cfg.profile) if cfg.profile else None
    except ValueError as e:
        raise SystemExit(f"benchmarks.scale: {e}") from e
    clustered = [label for label, x in labels.items() if x.clustered]
    if clustered and not (profile and profile.tables[0].distinct_per_samples_clustered):
        raise SystemExit(
            f"benchmarks.scale: {clustered} need distinct ids counted after clustering, and "
            f"profile={cfg.profile} has none. Fix: a profile.json from python -m "
            "sharding.profile, or no +cluster in schedules"
        )
    return labels, profile


def scale_points(cfg: ScaleConfig) -> tuple[list[dict], dict]:
    """Every (family, size, planner, schedule) point, and the plans' timelines source."""
    from sharding.plan_eval import plan_cost

    labels, profile = schedules_and_profile(cfg)
    points, keep = [], {}
    # the timeline's size: the largest one simulated up to timeline_workers
    shown = max((w for w in cfg.workers if w <= cfg.timeline_workers), default=min(cfg.workers))
    for family, how in cfg.families.items():
        for workers in cfg.workers:
            spec = cluster_at(family, how, workers, cfg.oversubscription, cfg.allreduce)
            if spec is None:
                continue
            for planner in cfg.planners:
                if planner.startswith("torchrec") and workers > cfg.torchrec_max_workers:
                    continue
                plan, inputs, planning_s = plan_at(cfg, spec, planner, profile)
                cost = plan_cost(plan, inputs)
                headroom = min(
                    1 - d["hbm_used_bytes"] / max(d["hbm_cap_bytes"], 1) for d in plan.devices
                )
                lookups = [d["lookup_ms"] for d in plan.devices]  # the slowest over the mean
                imbalance = max(lookups) / max(sum(lookups) / len(lookups), 1e-12)
                for label, parsed in labels.items():
                    sim, priced, volume = simulate_label(cost, parsed, plan, inputs, profile)
                    points.append(
                        {
                            "family": family,
                            "workers": workers,
                            "planner": planner,
                            "schedule": label,
                            "step_ms": 1000 * sim.step_s,
                            "exposed_comm_ms": 1000 * sim.exposed_comm_s,
                            "closed_form_ms": 1000
                            * priced.step_s(parsed.schedule, parsed.micro_batches),
                            "dedup_counts": volume.source if volume else None,
                            "lookup_ms": 1000 * (max(cost.lookup_fwd_s) + max(cost.lookup_bwd_s)),
                            "samples_per_s": sum(plan.batch_per_rank) / sim.step_s,
                            "headroom": headroom,
                            "feasible": plan.feasible,
                            "lookup_imbalance": imbalance,
                            "planning_s": planning_s,
                        }
                    )
                    if workers == shown and planner == cfg.planners[0] and not parsed.dedup:
                        keep[(family, label)] = sim
                print(
                    f"{family} {workers:>5} workers, {planner}: planned in {planning_s:.1f} s",
                    flush=True,
                )
    for p in points:  # throughput per worker against the family's smallest size
        base = min(
            (
                q
                for q in points
                if q["family"] == p["family"]
                and q["planner"] == p["planner"]
                and q["schedule"] == p["schedule"]
            ),
            key=lambda q: q["workers"],
        )
        per_worker = p["samples_per_s"] / p["workers"]
        p["scaling_efficiency"] = per_worker / (base["samples_per_s"] / base["workers"])
    return points, keep


def validation_settings() -> list[dict]:
    """Measured settings whose config is known: the calibration's validation runs and the
    pipeline benchmark on the emulated mixed cluster."""
    out = []
    cal = json.loads((RESULTS / "calibrate" / "summary.json").read_text())
    for v in cal["validation"]:  # with the cores' speed measured beside it, where it was
        out.append(
            {
                "setting": v["setting"],
                "overrides": v["overrides"],
                "link": v["link"],
                "measured_ms": v["measured_ms"],
                "cores_speed": v.get("cores_speed", 1.0),
            }
        )
    emu = json.loads((RESULTS / "pipeline_emu_mixed4" / "summary.json").read_text())
    c = emu["config"]
    from benchmarks.pipeline import pipeline_overrides

    link_bytes = {row["pipeline"]: row["link_bytes"] for row in emu["rows"]}
    for row in emu["rows"]:
        label = row["pipeline"]
        extra = {}
        plain = label.replace("+dedup_fwd", "").replace("+dedup", "")  # its pooled twin
        if plain != label and plain in link_bytes:
            extra["measured_link_ratio"] = row["link_bytes"] / link_bytes[plain]

        overrides = ["cluster=emu_mixed4", *c["overrides"], *pipeline_overrides(label)]
        out.append(
            {
                "setting": f"emu_mixed4 {label}",
                "overrides": overrides,
                "link": "emu_mixed4",
                "measured_ms": row["step_ms"],
                "cores_speed": 1.0,
                **extra,
            }
        )
    return out


def label_of(tcfg) -> str:
    """The schedule label of a training config's pipeline (`schedule_of_label`'s input)."""
    p = tcfg.pipeline
    if p.name.value != "nested":
        return p.name.value
    return (
        f"nested{p.micro_batches}"
        + ("+dedup" if p.dedup_grads else "+dedup_fwd") * p.dedup
        + "+cluster" * (p.dedup and p.cluster_samples)
    )


def measured_profile(tcfg, batch_size: int = 2048, batches: int = 4):
    """The access profile of a setting's own data, with distinct ids per micro-batch."""
    from recsys.app.profile import ProfileAppConfig, profile_dataset

    cfg = ProfileAppConfig(
        dataset=tcfg.dataset,
        model=tcfg.model,
        batches=batches,
        batch_size=batch_size,
        distinct_batches=batches,
    )
    return profile_dataset(cfg)


def validate() -> list[dict]:
    """The simulator's step for each measured setting, with the saved calibration at the
    cores' speed measured beside the setting (`benchmarks.calibrate`'s meter; 1 where none
    was)."""
    from benchmarks.calibrate import cores_at_speed
    from recsys.app.planning import make_plan, plan_inputs
    from sharding.calibration import load_calibration
    from sharding.plan_eval import plan_cost

    rows, profiles, cal = [], {}, load_calibration()
    for s in validation_settings():
        tcfg = _compose(s["overrides"])  # the measured runs trained on every rank
        tcfg = replace(tcfg, planner=replace(tcfg.planner, leave_out=False))
        inputs = plan_inputs(tcfg, None, s["link"], cores_at_speed(cal, s["cores_speed"]))
        plan = make_plan(tcfg, inputs)
        cost = plan_cost(plan, inputs)
        label = schedule_of_label(label_of(tcfg))
        profile = None
        if label.dedup:  # the distinct ids of the run's own data
            key = repr((tcfg.dataset, tcfg.model))
            profile = profiles.get(key) or profiles.setdefault(key, measured_profile(tcfg))
        sim, priced, volume = simulate_label(cost, label, plan, inputs, profile)
        predicted = 1000 * sim.step_s
        closed = 1000 * priced.step_s(label.schedule, label.micro_batches)
        rows.append(
            {
                **s,
                "predicted_ms": predicted,
                "closed_form_ms": closed,
                "rel_error": (predicted - s["measured_ms"]) / s["measured_ms"],
                "dedup": label.dedup,
            }
        )
        if volume is not None:  # what dedup sends, embedding rows / pooled vectors (both
            # ways; +dedup_fwd: the forward's rows and the pooled gradients)
            both = volume.vectors if label.dedup_grads else [(1 + v) / 2 for v in volume.vectors]
            rows[-1]["predicted_volume_ratio"] = statistics.mean(both)
    return rows


def validation_summary(rows: list[dict]) -> dict:
    """Median absolute error over every setting, and over the exact pipelines only (the
    simulator prices dedup's wire volume, not its CPU work: see docs/scale.md)."""
    exact = [r for r in rows if not r["dedup"]]
    return {
        "median_abs_error": statistics.median(abs(r["rel_error"]) for r in rows),
        "median_abs_error_without_dedup": statistics.median(abs(r["rel_error"]) for r in exact),
        "worst_setting": max(rows, key=lambda r: abs(r["rel_error"]))["setting"],
        "worst_setting_without_dedup": max(exact, key=lambda r: abs(r["rel_error"]))["setting"],
    }


def plot_scaling(points: list[dict], path: Path) -> None:
    """Scaling efficiency per family: a colour per schedule, a line style per planner, one
    legend for each beside the panels (schedules equal at every size share a line)."""
    from benchmarks.plots import _plt

    plt = _plt()
    families = sorted({p["family"] for p in points})
    fig, axes = plt.subplots(
        1, len(families), figsize=(5.8 * len(families) + 2.2, 4.5), squeeze=False
    )
    schedules = list(dict.fromkeys(p["schedule"] for p in points))
    planners = list(dict.fromkeys(p["planner"] for p in points))
    color = dict(zip(schedules, plt.get_cmap("tab10").colors, strict=False))
    style = {"hybrid": "-", "torchrec": ":", "round_robin": "--", "greedy_size": "-."}
    for ax, family in zip(axes[0], families, strict=True):
        for planner in planners:
            for schedule in schedules:
                pts = sorted(
                    (
                        p
                        for p in points
                        if p["family"] == family
                        and p["planner"] == planner
                        and p["schedule"] == schedule
                    ),
                    key=lambda p: p["workers"],
                )
                if pts:
                    ax.plot(
                        [p["workers"] for p in pts],
                        [p["scaling_efficiency"] for p in pts],
                        marker="o",
                        ms=3,
                        lw=1.6 if planner == "hybrid" else 0.9,
                        ls=style.get(planner, "-"),
                        color=color[schedule],
                    )
        sizes = sorted({p["workers"] for p in points if p["family"] == family})
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(w) for w in sizes], fontsize=7)
        ax.set_xlabel("workers")
        ax.set_ylabel("throughput per worker / the smallest size's")
        ax.set_title(f"{family} family (simulated)", fontsize=9)
        ax.grid(alpha=0.3)
    line = plt.Line2D
    by_schedule = [line([], [], color=color[s], lw=2, label=s) for s in schedules]
    by_planner = [line([], [], color="k", ls=style.get(p, "-"), label=p) for p in planners]
    first = fig.legend(
        handles=by_schedule,
        title="schedule",
        fontsize=7,
        title_fontsize=8,
        loc="upper right",
        bbox_to_anchor=(1.0, 0.93),
    )
    fig.add_artist(first)
    fig.legend(
        handles=by_planner,
        title="planner",
        fontsize=7,
        title_fontsize=8,
        loc="lower right",
        bbox_to_anchor=(1.0, 0.12),
    )
    fig.suptitle("Scaling efficiency per schedule (colour) and planner (line)", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1 - 2.0 / fig.get_figwidth(), 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timeline(sims: dict, path: Path, ranks: int = 2) -> None:
    """One steady-state step per schedule: each of a few ranks' queues (device, NIC share,
    link within the node, host-device link), the queues a step leaves empty left out."""
    from benchmarks.plots import _plt

    plt = _plt()
    colors = {
        "lookup": "tab:blue",
        "dense": "tab:green",
        "emb": "tab:orange",
        "grad": "tab:red",
        "ids": "tab:purple",
        "allreduce": "tab:brown",
        "update": "tab:gray",
        "overheads": "tab:pink",
        "copy": "tab:olive",
    }
    names = {
        "emb": "embedding chunks",
        "grad": "gradient chunks",
        "update": "lookup backward, update, overheads",
        "overheads": "optimizer step, overheads (nested)",
        "copy": "batch to the device",
    }
    panels = []
    for (family, label), sim in sims.items():
        t, k = sim.timeline, sim.last_step
        t0 = t.end(f"s{k - 1}:done")
        rows = []
        for name, (a, b) in t.spans.items():
            step, _, rest = name.partition(":")
            if "@" not in rest or step not in (f"s{k}", f"s{k + 1}") or b <= t0 or b <= a:
                continue
            kind, rank = rest.split("@")
            rank = rank.split("/")[0]  # an exchange's task per link: <rank>/<link>
            if int(rank) >= ranks:
                continue
            lane = f"rank {rank} {t.resources[name].split(':')[0]}"
            rows.append((lane, a - t0, b - a, colors.get(kind.rstrip("0123456789"), "k")))
        panels.append((f"{family}, {label}: one step, {sim.step_s * 1e3:.1f} ms", sim, rows))
    heights = [max(2, len({r[0] for r in rows})) for _, _, rows in panels]
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(11, 1.0 + 0.22 * sum(heights) + 0.45 * len(panels)),
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    for ax, (title, sim, rows) in zip(axes[:, 0], panels, strict=True):
        lanes = sorted({r[0] for r in rows})
        for lane, a, w, c in rows:
            ax.barh(lanes.index(lane), w * 1e3, left=a * 1e3, color=c, edgecolor="white", lw=0.3)
        ax.set_yticks(range(len(lanes)), lanes, fontsize=6)
        ax.set_title(title, fontsize=8)
        ax.axvline(sim.step_s * 1e3, color="k", lw=0.8)
    axes[-1, 0].set_xlabel("ms from the previous step's end")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, [names.get(k, k) for k in colors], fontsize=7, ncol=4, loc="lower center")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(result: dict) -> str:
    c = result["config"]
    lines = [
        f"# Scale study (simulated; {result['environment']['date']}, model {c['model']}, "
        f"batch {c['batch_per_worker']} per worker, dense in {c.get('precision', 'fp32')}, "
        f"oversubscription "
        f"{c['oversubscription']:g})",
        "",
    ]
    if "host_floor_ms" in result:
        host = c.get("host_s_per_sample")
        priced = (
            "at this machine's calibrated rate"
            if host is None
            else "the batch ready"
            if host == 0
            else f"{host * 1e6:.2f} us a sample"
        )
        lines += [
            f"GPU hosts' batch assembly in the steps below: {priced}. In the trainer's "
            f"one prefetch thread a rank at this machine's calibrated rate a batch takes "
            f"{result['host_floor_ms']:.2f} ms, a floor on every step.",
            "",
        ]
    v = result.get("validation")
    if v:
        lines += [
            "| measured setting | cores' speed beside | simulated ms | closed form ms | "
            "measured ms | error |",
            "|---|---|---|---|---|---|",
        ]
        for r in v:
            lines.append(
                f"| {r['setting']} | {r.get('cores_speed', 1.0):.2f}x | "
                f"{r['predicted_ms']:.1f} | {r['closed_form_ms']:.1f} "
                f"| {r['measured_ms']:.1f} | {r['rel_error']:+.0%} |"
            )
        lines += [
            "",
            f"Simulator: median absolute error {result['median_abs_error']:.1%} over "
            f"every setting, worst {result['worst_setting']}; without dedup "
            f"{result['median_abs_error_without_dedup']:.1%}, worst "
            f"{result['worst_setting_without_dedup']}.",
            "",
        ]
        dedup = [r for r in v if "measured_link_ratio" in r]
        if dedup:
            lines += [
                "| dedup setting | predicted exchange volume vs without | measured link "
                "bytes vs without |",
                "|---|---|---|",
            ]
            lines += [
                f"| {r['setting']} | {r['predicted_volume_ratio']:.2f} | "
                f"{r['measured_link_ratio']:.2f} |"
                for r in dedup
            ]
            lines.append("")
    lines += [
        "| family | workers | planner | schedule | step ms | exposed comm ms | scaling "
        "efficiency | headroom | lookup imbalance |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in result["points"]:
        lines.append(
            f"| {p['family']} | {p['workers']} | {p['planner']} | {p['schedule']} | "
            f"{p['step_ms']:.2f} | {p['exposed_comm_ms']:.2f} | "
            f"{p['scaling_efficiency']:.0%} | {p['headroom']:.0%} | "
            f"{p.get('lookup_imbalance', float('nan')):.2f}x |"
        )
    return "\n".join(lines)


ConfigStore.instance().store(name="base_bench_scale", node=ScaleConfig)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="bench_scale")
@benchmark_command
def main(cfg: DictConfig) -> None:
    from benchmarks.common import output_dirs
    from recsys.config import register_configs
    from sharding.calibration import host_assembly_s

    register_configs()
    typed: ScaleConfig = start(cfg)
    schedules_and_profile(typed)  # bad schedules or profile: refused before the long work
    t0 = time.perf_counter()
    result: dict = {"config": OmegaConf.to_container(cfg), "environment": environment()}
    if typed.validation:
        v = validate()
        result["validation"] = v
        result.update(validation_summary(v))
    result["points"], sims = scale_points(typed)
    result["host_floor_ms"] = 1000 * typed.batch_per_worker * host_assembly_s()
    result["elapsed_s"] = time.perf_counter() - t0
    finish(result, table(result), "scale", typed, json_name="summary")
    for d in output_dirs(typed):
        if result["points"]:  # none with families=[]: the validation alone
            plot_scaling(result["points"], d / "scaling.png")
        if sims:
            plot_timeline(sims, d / "timeline.png")


if __name__ == "__main__":
    main()
