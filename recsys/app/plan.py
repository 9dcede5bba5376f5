"""`python -m sharding.plan cluster=... model=... planner=... [profile=profile.json]`

Plans the model's tables for the cluster with the chosen planner (hybrid, torchrec,
greedy_size, round_robin), judges the plan with the cost model, prints a table, and writes
into the Hydra run dir: `plan.json`, `plan_torchrec.txt` (the TorchRec ShardingPlan), and
`plan.png` (per rank: memory by tier against capacity, predicted time). Without `profile=`
a power law with `dataset.zipf_exponent` stands in for the access frequencies. A command
module (the planners are in `sharding.planners`).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from recsys.app.entry import hydra_command
from recsys.app.planning import PlanAppConfig, make_plan, plan_inputs, plan_json, torchrec_plans
from recsys.config import register_configs
from recsys.models.dlrm import feature_names
from sharding.access_profile import AccessProfile
from sharding.emit import to_torchrec_plan
from sharding.types import Plan, PlannerName


def plan_table(plan: Plan) -> str:
    gib = 2**30
    gap = plan.est_step_ms / plan.lower_bound_ms
    fits = "feasible" if plan.feasible else "DOES NOT FIT"
    w = max([len("sharding"), *(len(t.sharding_type) for t in plan.tables)])
    lines = [
        f"{plan.planner} plan for {plan.cluster}: predicted {plan.est_step_ms:.2f} ms/step "
        f"(dense in {plan.precision}), "
        f"lower bound {plan.lower_bound_ms:.2f} ms ({gap:.2f}x), planned in "
        f"{plan.planning_s:.2f} s, {fits}",
        *_parts_line(plan),
        "",
        f"{'table':12} {'rows':>12} {'dim':>4}  {'sharding':{w}} {'tier':6} {'replicated':>10}"
        "  ranks",
    ]
    for t in plan.tables:
        ranks = str(t.ranks) if len(t.ranks) <= 6 else f"{len(t.ranks)} ranks"
        lines.append(
            f"{t.name:12} {t.rows:>12,} {t.dim:>4}  {t.sharding_type:{w}} "
            f"{t.tier.value:6} {t.replicated_rows:>10,}  {ranks}"
        )
    lines += [
        "",
        f"{'rank':>4} {'kind':10} {'batch':>6} {'fast GiB':>9} {'of':>7} {'host GiB':>9} "
        f"{'of':>8} {'est ms':>8}",
    ]
    for d in plan.devices[:16]:
        lines.append(
            f"{d['rank']:>4} {d['kind']:10} {d['batch']:>6} {d['hbm_used_bytes'] / gib:>9.3f} "
            f"{d['hbm_cap_bytes'] / gib:>7.1f} {d['host_used_bytes'] / gib:>9.3f} "
            f"{d['host_cap_bytes'] / gib:>8.1f} {d['est_ms']:>8.2f}"
        )
    if len(plan.devices) > 16:
        lines.append(f"... {len(plan.devices) - 16} more ranks in plan.json")
    return "\n".join(lines)


def _parts_line(plan: Plan) -> list[str]:
    """What hybrid weighed leaving out (`planner.leave_out`), in one line; none if nothing."""
    if not plan.weighed:
        return []
    every = plan.weighed[0]
    parts = ", ".join(
        f"{w['what']} {w['est_step_ms']:.2f} ms"
        if "est_step_ms" in w
        else f"{w['what']} not weighed ({w['not_weighed']})"
        for w in plan.weighed[1:]
    )
    if plan.left_out:
        kept = next(w for w in plan.weighed if w["ranks"] == _kept(plan))
        return [
            f"leaves ranks {_short(plan.left_out)} out, training on {kept['what']}: predicted "
            f"{plan.est_step_ms:.2f} ms/step without them, {every['est_step_ms']:.2f} ms with "
            f"every device (weighed: {parts})"
        ]
    return [f"every device kept: no part of the cluster is predicted faster (weighed: {parts})"]


def _kept(plan: Plan) -> list[int]:
    world = len(plan.batch_per_rank) + len(plan.left_out)
    return [r for r in range(world) if r not in plan.left_out]


def _short(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks)) if len(ranks) <= 8 else f"{len(ranks)} ranks"


STAGE_COLORS = {
    "lookups": "tab:blue",
    "dense": "tab:green",
    "exchange": "tab:orange",
    "split tables": "tab:purple",
    "all-reduce": "tab:red",
    "overhead + input": "tab:gray",
    "exchange left exposed": "tab:orange",
    "quota-bound CPU": "tab:olive",
    "feeding the batch": "tab:brown",
}


def _rank_labels(plan: Plan) -> list[str]:
    many = len(plan.devices) > 16
    return [
        f"{d['rank']}:{d['kind']}" if many else f"rank {d['rank']}\n{d['kind']}"
        for d in plan.devices
    ]


def plot(plan: Plan, path: Path) -> None:
    """Per device, memory used against capacity per tier, and its own predicted stage times;
    beside them the step time split into its parts; the step and the bound as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(plan.devices)
    labels = _rank_labels(plan)
    width = max(8.0, 1.0 + 0.9 * n if n <= 16 else 0.22 * n)
    fig, (mem, t) = plt.subplots(2, 1, figsize=(width, 8), height_ratios=[1, 1.3])
    _memory_panel(mem, plan)
    step_x = _time_panel(t, plan)
    t.set_xticks(
        list(range(n)) + [step_x],
        labels + ["step"],
        fontsize=7 if n <= 16 else 6,
        rotation=0 if n <= 16 else 90,
    )
    mem.set_xticks(range(n), labels, fontsize=7 if n <= 16 else 6, rotation=0 if n <= 16 else 90)
    caption = (
        "The step (hatched bar) is not the tallest device: every stage waits for its "
        "slowest device (collectives), then the all-reduce and fixed overheads add on, "
        "and the schedule hides part of the exchange. The lower bound: no plan of these "
        "tables on these devices is faster under the cost model (docs/planning.md)."
    )
    fig.text(
        0.01, 0.005, "\n".join(textwrap.wrap(caption, int(width * 15))), fontsize=7, va="bottom"
    )
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _memory_panel(mem, plan: Plan) -> None:
    """Per device and tier: capacity after the reserve (outline) and used (filled)."""
    gib, devices = 2**30, plan.devices
    x = list(range(len(devices)))
    tiers = [("hbm", "fast memory (HBM; a CPU rank's budget)", "tab:blue")]
    if any(d["host_cap_bytes"] for d in devices):
        tiers.append(("host", "host memory", "tab:olive"))
    bar = 0.8 / len(tiers)
    for i, (tier, name, color) in enumerate(tiers):
        pos = [v + (i - (len(tiers) - 1) / 2) * bar for v in x]
        mem.bar(
            pos,
            [d[f"{tier}_cap_bytes"] / gib for d in devices],
            bar,
            fill=False,
            edgecolor=color,
            label=f"{name}: capacity after the reserve",
        )
        mem.bar(
            pos,
            [d[f"{tier}_used_bytes"] / gib for d in devices],
            bar,
            color=color,
            alpha=0.8,
            label=f"{name}: used (weights + optimizer state)",
        )
    mem.set_ylabel("GiB")
    mem.set_title(f"{plan.planner} plan on {plan.cluster}: memory per device")
    mem.legend(fontsize=7, loc="upper right")
    mem.set_ylim(0, 1.35 * max(max(d["hbm_cap_bytes"], d["host_cap_bytes"]) for d in devices) / gib)
    if len(devices) <= 16:  # the used amount, readable even when a sliver of the capacity
        for v, d in zip(x, devices, strict=True):
            used = (d["hbm_used_bytes"] + d["host_used_bytes"]) / gib
            mem.annotate(
                f"{used:.3g} GiB used",
                (v, used),
                ha="center",
                va="bottom",
                fontsize=7,
                xytext=(0, 2),
                textcoords="offset points",
            )


def _time_panel(t, plan: Plan) -> float:
    """Per device its own stage times, stacked; a bar apart: the step's parts; the step and
    the lower bound as lines. Returns the step bar's x."""
    devices, n = plan.devices, len(plan.devices)
    bottom, named = [0.0] * n, set()
    for key, name in (
        ("lookup_ms", "lookups"),
        ("dense_ms", "dense"),
        ("exchange_ms", "exchange"),
        ("split_ms", "split tables"),
    ):
        values = [d.get(key, 0.0) for d in devices]
        if any(values):
            t.bar(range(n), values, 0.7, bottom=bottom, color=STAGE_COLORS[name], label=name)
            named.add(name)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    step_x = n + 0.5
    top = 0.0
    for name, ms in plan.step_parts_ms.items():
        if ms > 0:
            t.bar(
                step_x,
                ms,
                0.9,
                bottom=top,
                color=STAGE_COLORS[name],
                hatch="//",
                edgecolor="white",
                label=None if name in named else name,
            )
            top += ms
    t.axhline(plan.est_step_ms, color="k", lw=1.2, label=f"step: {plan.est_step_ms:.2f} ms")
    if plan.lower_bound_ms:
        t.axhline(
            plan.lower_bound_ms,
            color="k",
            ls="--",
            lw=1,
            label=f"lower bound: {plan.lower_bound_ms:.2f} ms",
        )
    t.set_ylim(0, 1.4 * max(top, plan.est_step_ms, *bottom))
    t.set_ylabel("predicted ms per step")
    t.set_title(
        f"predicted time per device (its own stages) and the step ({plan.schedule}"
        f"{f', {plan.micro_batches} micro-batches' if plan.schedule == 'nested' else ''})"
    )
    t.legend(fontsize=7, loc="upper left", ncol=2)
    return step_x


register_configs()


@hydra_command("plan")
def main(typed: PlanAppConfig, out: Path) -> None:
    profile = AccessProfile.load(typed.profile) if typed.profile else None
    inputs = plan_inputs(typed, profile, typed.link, profile_path=typed.profile or "")
    note = ""
    if typed.planner.name == PlannerName.torchrec:
        tr = torchrec_plans(typed, inputs)
        plan = tr.chosen
        note = (
            f"TorchRec rated {tr.proposals} plans and chose the best under its own "
            f"estimate ({tr.own_estimate_ms:.2f} ms by its model); the fastest of them "
            f"under our cost model: {tr.best_ours.est_step_ms:.2f} ms"
        )
    else:
        plan = make_plan(typed, inputs)
    (out / "plan.json").write_text(json.dumps(plan_json(plan), indent=1) + "\n")
    text = plan.torchrec_text
    if text is None:
        feature_of = {f"t_{n}": n for n in feature_names(typed.model)}
        device_type = "cpu" if inputs.cpu else "cuda"
        text = str(to_torchrec_plan(plan, feature_of, device_type))
    (out / "plan_torchrec.txt").write_text(text)
    plot(plan, out / "plan.png")
    print(plan_table(plan))
    if note:
        print(note)
    print(f"written: {out / 'plan.json'}, {out / 'plan_torchrec.txt'}, {out / 'plan.png'}")


if __name__ == "__main__":
    main()
