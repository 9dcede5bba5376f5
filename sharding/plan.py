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
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from recsys.config import register_configs
from recsys.models.dlrm import feature_names
from recsys.planning import PlanAppConfig, make_plan, plan_inputs, plan_json, torchrec_plans
from sharding.access_profile import AccessProfile
from sharding.cluster import ClusterConfigError
from sharding.emit import to_torchrec_plan
from sharding.plan_eval import Plan, PlanDoesNotFitError
from sharding.types import PlannerName


def plan_table(plan: Plan) -> str:
    gib = 2**30
    gap = plan.est_step_ms / plan.lower_bound_ms
    fits = "feasible" if plan.feasible else "DOES NOT FIT"
    w = max([len("sharding"), *(len(t.sharding_type) for t in plan.tables)])
    lines = [
        f"{plan.planner} plan for {plan.cluster}: predicted {plan.est_step_ms:.2f} ms/step, "
        f"lower bound {plan.lower_bound_ms:.2f} ms ({gap:.2f}x), planned in "
        f"{plan.planning_s:.2f} s, {fits}",
        "",
        f"{'table':12} {'rows':>12} {'dim':>4}  {'sharding':{w}} {'tier':6} {'replicated':>10}"
        "  ranks",
    ]
    for t in plan.tables:
        ranks = str(t.ranks) if len(t.ranks) <= 6 else f"{len(t.ranks)} ranks"
        lines.append(f"{t.name:12} {t.rows:>12,} {t.dim:>4}  {t.sharding_type:{w}} "
                     f"{t.tier.value:6} {t.replicated_rows:>10,}  {ranks}")  # fmt: skip
    lines += ["", f"{'rank':>4} {'kind':10} {'batch':>6} {'fast GiB':>9} {'of':>7} {'host GiB':>9} "
              f"{'of':>8} {'est ms':>8}"]  # fmt: skip
    for d in plan.devices[:16]:
        lines.append(
            f"{d['rank']:>4} {d['kind']:10} {d['batch']:>6} {d['hbm_used_bytes'] / gib:>9.3f} "
            f"{d['hbm_cap_bytes'] / gib:>7.1f} {d['host_used_bytes'] / gib:>9.3f} "
            f"{d['host_cap_bytes'] / gib:>8.1f} {d['est_ms']:>8.2f}"
        )
    if len(plan.devices) > 16:
        lines.append(f"... {len(plan.devices) - 16} more ranks in plan.json")
    return "\n".join(lines)


def plot(plan: Plan, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = [d["rank"] for d in plan.devices]
    gib = 2**30
    fig, (mem, t) = plt.subplots(2, 1, figsize=(max(8, len(ranks) * 0.25), 7), sharex=True)
    fast = [d["hbm_used_bytes"] / gib for d in plan.devices]
    host = [d["host_used_bytes"] / gib for d in plan.devices]
    mem.bar(ranks, fast, label="fast memory (HBM / CPU rank budget)")
    mem.bar(ranks, host, bottom=fast, label="host memory")
    mem.plot(
        ranks, [d["hbm_cap_bytes"] / gib for d in plan.devices], "k_", ms=12, label="fast capacity"
    )
    mem.set_ylabel("GiB")
    mem.legend(fontsize=7)
    mem.set_title(f"{plan.planner} on {plan.cluster}: {plan.est_step_ms:.2f} ms/step predicted, "
                  f"lower bound {plan.lower_bound_ms:.2f} ms")  # fmt: skip
    t.bar(ranks, [d["est_ms"] for d in plan.devices], color="tab:green")
    t.set_ylabel("predicted ms (own stages)")
    t.set_xlabel("rank")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="plan")
def main(cfg: DictConfig) -> None:
    from recsys.train import quiet_library_noise

    quiet_library_noise()
    typed: PlanAppConfig = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    out = Path(HydraConfig.get().runtime.output_dir)
    try:
        profile = AccessProfile.load(typed.profile) if typed.profile else None
        inputs = plan_inputs(typed, profile, typed.link, profile_path=typed.profile or "")
        note = ""
        if typed.planner.name == PlannerName.torchrec:
            tr = torchrec_plans(typed, inputs)
            plan = tr.chosen
            note = (f"TorchRec rated {tr.proposals} plans and chose the best under its own "
                    f"estimate ({tr.own_estimate_ms:.2f} ms by its model); the fastest of them "
                    f"under our cost model: {tr.best_ours.est_step_ms:.2f} ms")  # fmt: skip
        else:
            plan = make_plan(typed, inputs)
    except (PlanDoesNotFitError, ClusterConfigError, FileNotFoundError, KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
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
