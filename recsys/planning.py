"""Plan a training config's tables with the configured planner, judged by the cost model.

Shared by `python -m sharding.plan`, the trainer (which runs the plan) and the planner
benchmark. Lives in `recsys` because it reads the model config; `sharding` stays free of it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from hydra.core.config_store import ConfigStore

from recsys.config import TrainConfig, register_configs
from recsys.models.cost_inputs import model_cost
from sharding.access_profile import AccessProfile
from sharding.calibration import Calibration, device_costs, load_calibration, network_cost
from sharding.cluster import compute_device_type, resolve_cluster
from sharding.cost_model import schedule_of
from sharding.plan_eval import Plan, PlanInputs, equal_batch, evaluate, power_law_coverage
from sharding.plan_shards import plan_layout, shards_from_layout
from sharding.planners import PLANNERS, TablePlan, finish_table
from sharding.types import PlannerName


@dataclass
class PlanAppConfig(TrainConfig):
    profile: str | None = None  # a profile.json from sharding.profile
    link: str | None = None  # CPU clusters: calibrated link (loopback, veth_1gbit)


register_configs()
ConfigStore.instance().store(name="base_plan", node=PlanAppConfig)


def plan_inputs(
    cfg: TrainConfig,
    profile: AccessProfile | None,
    link: str | None,
    cal: Calibration | None = None,
) -> PlanInputs:
    """The planner's inputs; CPU clusters use `cal`, or the saved calibration."""
    ranks = resolve_cluster(cfg.cluster)
    cpu = compute_device_type(ranks) == "cpu"
    cal = cal or (load_calibration() if cpu else None)
    pooling = {t.name: t.lookups_per_sample for t in profile.tables} if profile else None
    mc = model_cost(cfg.model, pooling)
    coverage = {}
    for t in mc.tables:
        if profile is not None:
            coverage[t.name] = profile.table(t.name).hit_rate
        else:
            coverage[t.name] = power_law_coverage(t.rows, cfg.dataset.zipf_exponent)
    return PlanInputs(
        tables=mc.tables,
        coverage=coverage,
        ranks=ranks,
        devices=device_costs(ranks, cal),
        network=network_cost(cfg.cluster, ranks, cal, link or cfg.planner.link),
        global_batch=cfg.trainer.batch_size * len(ranks),
        dense_params=mc.dense_params,
        interaction_flops_per_sample=mc.interaction_flops_per_sample,
        schedule=schedule_of(cfg.pipeline.name.value),
        micro_batches=cfg.pipeline.micro_batches,
        cpu=cpu,
        reserve=cfg.planner.storage_reservation,
        cluster=cfg.cluster.name,
        cold_only_exchange=cfg.planner.cold_only_exchange,
    )


def torchrec_plan(cfg: TrainConfig, inputs: PlanInputs) -> Plan:
    """TorchRec's planner, read back into our Plan so the same cost model judges it."""
    import torch
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    from recsys.models.dlrm import build_model
    from sharding.torchrec_planner import plan_with_torchrec

    model = build_model(cfg.model, dense_device=torch.device("meta"))
    sharders = [EmbeddingBagCollectionSharder()]
    tr_plan = plan_with_torchrec(model, inputs.ranks, sharders, cfg.trainer.batch_size, cfg.planner)
    shards = shards_from_layout(plan_layout(tr_plan), inputs.tables, inputs.world)
    tables = []
    for t in inputs.tables:
        own = [s for s in shards if s.table == t.name]
        dp = all(s.dp for s in own)
        tp = TablePlan(t.name, t.rows, t.dim, "data_parallel" if dp else "", [], own[0].tier,
                       hot_rows=t.rows if dp else 0, replicated_rows=t.rows if dp else 0,
                       shards=own)  # fmt: skip
        tables.append(finish_table(tp))  # data-parallel tables come back as they are
    batch = equal_batch(inputs.global_batch, inputs.world)
    return Plan("torchrec", inputs.cluster, tables, batch, torchrec_text=str(tr_plan))


def make_plan(cfg: TrainConfig, inputs: PlanInputs) -> Plan:
    start = time.perf_counter()
    name = PlannerName(cfg.planner.name)
    plan = (
        torchrec_plan(cfg, inputs) if name == PlannerName.torchrec else PLANNERS[name.value](inputs)
    )
    plan.planning_s = time.perf_counter() - start
    return evaluate(plan, inputs)


def plan_json(plan: Plan) -> dict:
    return {
        "planner": plan.planner,
        "cluster": plan.cluster,
        "feasible": plan.feasible,
        "est_step_ms": plan.est_step_ms,
        "lower_bound_ms": plan.lower_bound_ms,
        "planning_s": plan.planning_s,
        "a2a_bytes_per_step": plan.a2a_bytes_per_step,
        "devices": plan.devices,
        "tables": [
            {"name": t.name, "rows": t.rows, "dim": t.dim, "sharding_type": t.sharding_type,
             "ranks": t.ranks, "tier": t.tier.value, "hot_rows": t.hot_rows,
             "replicated_rows": t.replicated_rows, "cold_parts": t.cold_parts,
             "shards": [asdict(s) | {"tier": s.tier.value} for s in t.shards if not s.dp]}
            for t in plan.tables
        ],
    }  # fmt: skip
