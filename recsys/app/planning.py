"""Plan a training config's tables with the configured planner, judged by the cost model.

Shared by `python -m sharding.plan`, `python -m recsys.train` (which plans in the parent and
hands the ranks a RunContext) and the benchmarks. In the app layer because it reads the
training config and the model; `sharding` stays free of both.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from hydra.core.config_store import ConfigStore

from recsys.config import DenseAllreduce, TrainConfig, register_configs
from recsys.context import RunContext
from recsys.data.multi_hot import resolve_hotness
from recsys.models.cost_inputs import model_cost
from recsys.models.dlrm import table_configs
from sharding.access_profile import AccessProfile
from sharding.bound import lower_bound_ms
from sharding.calibration import (
    Calibration,
    constants_provenance,
    device_costs,
    load_calibration,
    network_cost,
    without_split_work,
)
from sharding.cluster import compute_device_type, resolve_cluster
from sharding.cost_model import schedule_of
from sharding.errors import UserError
from sharding.plan_check import check_inputs
from sharding.plan_eval import evaluate
from sharding.planners import PLANNERS
from sharding.subsets import candidates, subset
from sharding.torchrec_planner import TorchRecPlans
from sharding.two_d import best_with_groups, evaluate_two_d, group_inputs
from sharding.types import (
    Plan,
    PlanInputs,
    PlannerName,
    PowerLawCoverage,
    Shard,
    TablePlan,
    TableStats,
    Tier,
)


@dataclass
class PlanAppConfig(TrainConfig):
    profile: str | None = None  # a profile.json from recsys.app.profile
    link: str | None = None  # CPU clusters: calibrated link (loopback, veth_1gbit)


register_configs()
ConfigStore.instance().store(name="base_plan", node=PlanAppConfig)


class PlanConfigError(UserError, ValueError):
    """A training config key that the planner cannot use."""


def check_plan_config(cfg: TrainConfig) -> None:
    """The config keys the planner reads, checked before anything is planned."""
    if not cfg.trainer.batch_size >= 1:
        raise PlanConfigError(
            f"trainer.batch_size must be >= 1 sample per rank, got {cfg.trainer.batch_size}"
        )
    reserve = cfg.planner.storage_reservation
    if not 0 <= reserve < 1:
        raise PlanConfigError(
            f"planner.storage_reservation is the share of each device's memory kept free; it "
            f"must lie in [0, 1), got {reserve}"
        )
    zipf = cfg.dataset.zipf_exponent  # the access skew planned without a measured profile
    if not (math.isfinite(zipf) and zipf > 0):
        raise PlanConfigError(
            f"dataset.zipf_exponent must be a finite number > 0 (p(k-th hottest row) ~ "
            f"k^-exponent; 1.1 by default), got {zipf}"
        )
    if cfg.planner.torchrec_min_partition < 4:
        raise PlanConfigError(
            f"planner.torchrec_min_partition must be >= 4 columns, got "
            f"{cfg.planner.torchrec_min_partition}"
        )
    if cfg.planner.torchrec_timeout_s is not None and not cfg.planner.torchrec_timeout_s > 0:
        raise PlanConfigError(
            f"planner.torchrec_timeout_s must be > 0 seconds (or null), got "
            f"{cfg.planner.torchrec_timeout_s}"
        )


def check_profile(profile: AccessProfile, tables: list[TableStats], where: str) -> None:
    """A profile must describe this model's tables: the same names and row counts."""
    have = {t.name: t.rows for t in profile.tables}
    want = {t.name: t.rows for t in tables}
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    rows = [
        f"{n}: {have[n]:,} rows profiled, {want[n]:,} in the model"
        for n in sorted(set(have) & set(want))
        if have[n] != want[n]
    ]
    if missing or extra or rows:
        source = profile.source.get("model", "another model")
        raise PlanConfigError(
            f"profile {where} (of model '{source}') does not match this model's tables: "
            + "; ".join(
                x
                for x in (
                    f"missing {missing[:5]}" if missing else "",
                    f"not in the model {extra[:5]}" if extra else "",
                    "; ".join(rows[:3]),
                )
                if x
            )
            + ". Fix: profile this model (python -m sharding.profile model=...) or drop profile="
        )


def plan_inputs(
    cfg: TrainConfig,
    profile: AccessProfile | None,
    link: str | None,
    cal: Calibration | None = None,
    profile_path: str = "",
) -> PlanInputs:
    """The planner's inputs, checked; CPU clusters use `cal`, or `planner.calibration`'s
    file, or the saved calibration."""
    check_plan_config(cfg)
    ranks = resolve_cluster(cfg.cluster)
    cpu = compute_device_type(ranks) == "cpu"
    if cal is None and cpu:
        where = cfg.planner.calibration
        cal = load_calibration(Path(where)) if where else load_calibration()
    pooling = {t.name: t.lookups_per_sample for t in profile.tables} if profile else None
    hotness = resolve_hotness(cfg.dataset.hotness, len(cfg.model.num_embeddings_per_feature))
    if pooling is None and hotness is not None:  # no profile: the bags' own sizes
        pooling = {t.name: float(h) for t, h in zip(table_configs(cfg.model), hotness, strict=True)}
    mc = model_cost(cfg.model, pooling)
    if profile is not None:
        check_profile(profile, mc.tables, profile_path)
    coverage = {}
    for t in mc.tables:
        if profile is not None:
            coverage[t.name] = profile.table(t.name).hit_rate
        else:
            coverage[t.name] = PowerLawCoverage(t.rows, cfg.dataset.zipf_exponent)
    inputs = PlanInputs(
        tables=mc.tables,
        coverage=coverage,
        ranks=ranks,
        devices=device_costs(ranks, cal, cfg.trainer.precision.value, cfg.cluster.name),
        precision=cfg.trainer.precision.value,
        network=replace(
            network_cost(cfg.cluster, ranks, cal, link or cfg.planner.link),
            hierarchical_allreduce=DenseAllreduce(cfg.trainer.dense_allreduce)
            == DenseAllreduce.hierarchical,
        ),
        global_batch=cfg.trainer.batch_size * len(ranks),
        dense_params=mc.dense_params,
        interaction_flops_per_sample=mc.interaction_flops_per_sample,
        activation_bytes_per_sample=mc.activation_bytes_per_sample,
        dense_features=mc.dense_features,
        schedule=schedule_of(cfg.pipeline.name.value),
        micro_batches=cfg.pipeline.micro_batches,
        cpu=cpu,
        reserve=cfg.planner.storage_reservation,
        cluster=cfg.cluster.name,
        cold_only_exchange=cfg.planner.cold_only_exchange,
    )
    check_inputs(inputs)
    return inputs


def torchrec_plans(cfg: TrainConfig, inputs: PlanInputs) -> TorchRecPlans:
    """TorchRec's planner on the model itself (so its plan text names the trainer's
    modules), its choice and its best under our cost model read back as our Plans."""
    import torch

    from recsys.models.dlrm import build_model
    from sharding.torchrec_planner import torchrec_plans as plan_tables

    model = build_model(cfg.model, dense_device=torch.device("meta"))
    return plan_tables(inputs, cfg.planner, model)


def make_plan(cfg: TrainConfig, inputs: PlanInputs) -> Plan:
    """The configured planner's plan (TorchRec's: its own choice), evaluated. With
    `trainer.sharding_group_size`, one group's plan (2D groups, `sharding.two_d`); with
    `planner.two_d`, the faster of the plan for every rank and each 2D plan; with
    `trainer.dense_allreduce=auto` on more than one node, the faster of the plans made
    under a flat and a hierarchical dense reduction."""
    if DenseAllreduce(cfg.trainer.dense_allreduce) == DenseAllreduce.auto:
        modes = [DenseAllreduce.buckets]
        if len({r.node for r in inputs.ranks}) > 1:
            modes.append(DenseAllreduce.hierarchical)
        plans = [make_plan(*_under(cfg, inputs, mode)) for mode in modes]
        return min(plans, key=lambda p: (not p.feasible, p.est_step_ms))
    start = time.perf_counter()
    group = cfg.trainer.sharding_group_size
    if group and group != inputs.world:
        plan = _planned(cfg, group_inputs(inputs, group))
        plan.sharding_group_size = group
        plan = evaluate_two_d(plan, inputs)
    else:
        plan = _planned(cfg, inputs)
        if cfg.planner.two_d:
            plan = best_with_groups(plan, inputs, lambda g: _planned(cfg, g))
        elif cfg.planner.leave_out and PlannerName(cfg.planner.name) == PlannerName.hybrid:
            plan = _with_fewer_devices(cfg, inputs, plan)
    plan.planning_s = time.perf_counter() - start
    return plan


def on_part(
    cfg: TrainConfig, inputs: PlanInputs, keep: list[int], cal: Calibration | None = None
) -> tuple[TrainConfig, PlanInputs]:
    """`cfg` and `inputs` on the ranks `keep` of the cluster alone (`sharding.subsets`):
    the same tables, access frequencies and global batch; priced with `cal` (None: as
    `plan_inputs` finds it)."""
    part_cfg = replace(cfg, cluster=subset(cfg.cluster, keep))
    part = plan_inputs(part_cfg, None, None, cal)
    return part_cfg, replace(
        part, tables=inputs.tables, coverage=inputs.coverage, global_batch=inputs.global_batch
    )


def _with_fewer_devices(cfg: TrainConfig, inputs: PlanInputs, plan: Plan) -> Plan:
    """The fastest of `plan` and hybrid's plan on each part of the cluster worth weighing
    (`sharding.subsets.candidates`), each part's prediction or why it was not weighed kept in
    `weighed`; a part's plan names the ranks it leaves out. A part whose lower bound is no
    faster than the best plan so far is not planned: no plan there could win."""
    weighed: list[dict] = [
        {
            "ranks": list(range(inputs.world)),
            "what": "every device",
            "est_step_ms": plan.est_step_ms,
            "feasible": plan.feasible,
        }
    ]
    best, best_keep = plan, None
    alone = replace(cfg, planner=replace(cfg.planner, leave_out=False))
    for keep, what in candidates(cfg.cluster):
        entry: dict = {"ranks": keep, "what": what}
        weighed.append(entry)
        try:
            part_cfg, part = on_part(alone, inputs, keep)
            bound = lower_bound_ms(part)
            if bound >= best.est_step_ms:  # no plan there can win: not planned
                entry.update(lower_bound_ms=bound, not_weighed="its lower bound is slower")
                continue
            made = make_plan(part_cfg, part)
        except UserError as e:  # not calibrated, or it cannot hold the tables
            entry["not_weighed"] = str(e)
            continue
        entry.update(est_step_ms=made.est_step_ms, feasible=made.feasible)
        if made.feasible and made.est_step_ms < best.est_step_ms:
            best, best_keep = made, keep
    if best_keep is not None:
        best.left_out = [r for r in range(inputs.world) if r not in best_keep]
    best.weighed = weighed
    return best


def _under(
    cfg: TrainConfig, inputs: PlanInputs, mode: DenseAllreduce
) -> tuple[TrainConfig, PlanInputs]:
    """`cfg` and `inputs` with the dense reduction `mode`."""
    hierarchical = mode == DenseAllreduce.hierarchical
    network = replace(inputs.network, hierarchical_allreduce=hierarchical)
    trainer = replace(cfg.trainer, dense_allreduce=mode)
    return replace(cfg, trainer=trainer), replace(inputs, network=network)


def _planned(cfg: TrainConfig, inputs: PlanInputs) -> Plan:
    name = PlannerName(cfg.planner.name)
    if name == PlannerName.torchrec:
        return torchrec_plans(cfg, inputs).chosen
    return evaluate(PLANNERS[name.value](inputs), inputs)


def plan_with_splits(cfg: TrainConfig, cal: Calibration, link: str) -> Plan:
    """The hybrid plan for `cfg` planned across `link` with split tables' CPU work (the
    remap, the sequence exchange's) set to zero: where splitting tables pays even at small
    batches (across loopback the calibrated cost keeps them whole). For runs that need
    split tables to measure them: the split calibration, the tests."""
    return make_plan(cfg, plan_inputs(cfg, None, link, without_split_work(cal)))


def has_split_tables(plan: Plan) -> bool:
    return any(0 < t.replicated_rows < t.rows for t in plan.tables)


def plan_json(plan: Plan) -> dict:
    return {
        "planner": plan.planner,
        "cluster": plan.cluster,
        "feasible": plan.feasible,
        "est_step_ms": plan.est_step_ms,
        "lower_bound_ms": plan.lower_bound_ms,
        "schedule": plan.schedule,  # the pipeline schedule est_step_ms and the bound assume
        "micro_batches": plan.micro_batches,
        "precision": plan.precision,  # the dense part's, which est_step_ms prices
        "planning_s": plan.planning_s,
        "a2a_bytes_per_step": plan.a2a_bytes_per_step,
        "step_parts_ms": plan.step_parts_ms,  # est_step_ms split: slowest rank per stage, ...
        "devices": plan.devices,
        "sharding_group_size": plan.sharding_group_size,  # 2D: one group's plan (0: none)
        "dense_allreduce": plan.dense_allreduce,  # the dense reduction it prices: flat or by node
        # a plan for part of the cluster: the whole cluster's ranks it leaves out, and each
        # part hybrid weighed (its predicted step, or why it was not weighed)
        "left_out": plan.left_out,
        "weighed": plan.weighed,
        # per device kind: calibrated, measured by the GPU probe, or datasheet assumptions,
        # and where each constant comes from
        "constants": {
            k: constants_provenance(k) for k in sorted({d["kind"] for d in plan.devices})
        },
        "tables": [
            {
                "name": t.name,
                "rows": t.rows,
                "dim": t.dim,
                "sharding_type": t.sharding_type,
                "ranks": t.ranks,
                "tier": t.tier.value,
                "hot_rows": t.hot_rows,
                "replicated_rows": t.replicated_rows,
                "cold_parts": t.cold_parts,
                "shards": [asdict(s) | {"tier": s.tier.value} for s in t.shards],
            }
            for t in plan.tables
        ],
    }


class SavedPlanError(UserError, ValueError):
    """`trainer.plan` names a file that is no plan of this model and cluster."""


def saved_part(path: str, inputs: PlanInputs) -> list[int] | None:
    """The ranks of this run's cluster a saved plan for part of it keeps (None: the plan is
    for this cluster as it is, or a file that `load_plan` will refuse with its reason)."""
    try:
        raw = json.loads(Path(path).read_text())
        left_out, cluster = raw.get("left_out") or [], raw.get("cluster")
    except (OSError, ValueError, AttributeError):
        return None
    if not left_out or cluster == inputs.cluster:
        return None
    return [r for r in range(inputs.world) if r not in left_out]


def load_plan(path: str, inputs: PlanInputs) -> Plan:
    """`trainer.plan`: a plan.json our planners wrote (`python -m sharding.plan`, or a
    training run's), to train as it is; checked against this run's tables, cluster and world
    (one line naming what differs), then judged by the cost model as any plan is."""
    where = Path(path)
    try:
        raw = json.loads(where.read_text())
        tables = [
            TablePlan(
                t["name"],
                t["rows"],
                t["dim"],
                t["sharding_type"],
                t["ranks"],
                Tier(t["tier"]),
                t["hot_rows"],
                t["replicated_rows"],
                [Shard(**(s | {"tier": Tier(s["tier"])})) for s in t["shards"]],
                t.get("cold_parts", 1),
            )
            for t in raw["tables"]
        ]
        batch = [d["batch"] for d in raw["devices"]]
        planner, cluster = raw["planner"], raw["cluster"]
        group = raw.get("sharding_group_size", 0)
    except FileNotFoundError:
        raise SavedPlanError(
            f"trainer.plan: no file '{where}'; give a plan.json that `python -m sharding.plan` "
            f"or a training run wrote"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SavedPlanError(
            f"trainer.plan: '{where}' is not a plan.json of this version "
            f"({type(e).__name__}: {e}); plan again with python -m "
            f"sharding.plan"
        ) from None
    if cluster != inputs.cluster or len(batch) != (group or inputs.world):
        groups = f" (2D groups of {group})" if group else ""
        raise SavedPlanError(
            f"trainer.plan: '{where}' was made for cluster '{cluster}' with {len(batch)} ranks"
            f"{groups}; this run is on '{inputs.cluster}' with {inputs.world}: plan for this "
            f"cluster, or train on that one"
        )
    have = {(t.name, t.rows, t.dim) for t in tables}
    want = {(t.name, t.rows, t.dim) for t in inputs.tables}
    if have != want:
        differ = sorted(have ^ want)[0]
        raise SavedPlanError(
            f"trainer.plan: '{where}' holds another model's tables (first difference: "
            f"{differ[0]}, {differ[1]:,} x {differ[2]}); plan this model, or train that one"
        )
    replicas = inputs.world // len(batch)  # 2D: each group trains the plan's split
    if sum(batch) * replicas != inputs.global_batch:
        raise SavedPlanError(
            f"trainer.plan: '{where}' splits a global batch of {sum(batch) * replicas} samples; "
            f"this run's is {inputs.global_batch} (trainer.batch_size x ranks): set "
            f"trainer.batch_size={sum(batch) // len(batch)}, or plan this batch"
        )
    plan = Plan(planner, cluster, tables, batch, sharding_group_size=group)
    plan = evaluate_two_d(plan, inputs) if group else evaluate(plan, inputs)
    plan.left_out, plan.weighed = raw.get("left_out", []), raw.get("weighed", [])
    plan.planning_s = 0.0
    return plan


def run_context(cfg: TrainConfig, plan: Plan | None = None) -> RunContext:
    """`cfg` resolved for its ranks: the planner's inputs (and `plan`, one of ours, or None:
    TorchRec's planner plans in the ranks). What `recsys.app.train.train` hands its ranks;
    tests and benchmarks that spawn ranks themselves build theirs here."""
    return RunContext(cfg, plan_inputs(cfg, None, None), plan)
