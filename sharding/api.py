"""Hybrid planning for a TorchRec script: `HybridPlanner`, in TorchRec's planner's shape.

    from sharding.api import HybridPlanner, load_cluster

    planner = HybridPlanner(load_cluster("my_cluster.yaml"), batch_size=2048)
    plan = planner.collective_plan(model, sharders, pg)     # a torchrec ShardingPlan
    model = DistributedModelParallel(model, plan=plan, ...)
    my_batch = plan.batch_per_rank[rank]                    # hybrid's speed-aware shares

It finds every `EmbeddingBagCollection` of the model, whatever its module path, reads its
tables, prices each rank with the cluster's devices (calibrated or datasheet figures, as
`python -m sharding.plan` does) and returns a `HybridShardingPlan`: a TorchRec `ShardingPlan`
keyed by those module paths that also carries what TorchRec cannot express (the batch share
of each rank, the predicted step and its lower bound, the ranks left out, the full report).

What it plans: table placement (table-wise, column-wise, table-row-wise, whole-table
replication) and speed-aware batch shares. Hot-row replication and row parts change the
model's tables (`<name>_hot` / `<name>_cold`, with remapped ids): the project's trainer builds
that model, a user's script does not, so this planner never splits a table. A model whose
tables do not fit the cluster whole is refused.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sharding.resources import CONF_DIR, require_torchrec

try:
    from torchrec import EmbeddingBagCollection, EmbeddingCollection
    from torchrec.distributed.types import ShardingPlan
except ModuleNotFoundError:  # the library's entry: a missing torchrec said with its fix
    require_torchrec()
    raise

from sharding.access_profile import AccessProfile
from sharding.calibration import Calibration, device_costs, load_calibration, network_cost
from sharding.cluster import ClusterConfigError, compute_device_type, resolve_cluster
from sharding.emit import module_plan, parameter_shardings
from sharding.errors import UserError
from sharding.hybrid import HybridOptions, hybrid
from sharding.plan_eval import evaluate
from sharding.types import (
    ClusterSpec,
    DeviceGroup,
    EmulationSpec,
    NetworkSpec,
    NodeGroup,
    Plan,
    PlanInputs,
    PowerLawCoverage,
    Schedule,
    TableStats,
)

__all__ = [
    "HybridPlanner",
    "HybridShardingPlan",
    "ShareWeightedLoss",
    "check_plan_paths",
    "load_cluster",
]

PRESETS = CONF_DIR / "cluster"
# the planner's own ideas that keep the model's tables as they are
WHOLE_TABLES = HybridOptions(speed_aware=True, hot_rows=False, row_parts=False, pooled_hot=False)


class PlannerInputError(UserError, ValueError):
    """The model or arguments `HybridPlanner` was given cannot be planned."""


def load_cluster(source: str | Path) -> ClusterSpec:
    """A cluster layout from a YAML file (the format of `conf/cluster/`, Hydra's `defaults`
    key ignored) or a preset's name (`hetero_3node`); unknown keys are refused by name."""
    import yaml

    path = Path(source)
    if not path.suffix and not path.exists():
        path = PRESETS / f"{source}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in PRESETS.glob("*.yaml") if p.stem != "base_cluster")
        raise ClusterConfigError(
            f"no cluster file '{source}': give a YAML file (docs/clusters.md) or a preset: "
            f"{', '.join(known)}"
        )
    raw = yaml.safe_load(path.read_text()) or {}
    raw.pop("defaults", None)
    return _cluster_from(raw, str(path))


def _built(cls: type, raw: dict, where: str) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ClusterConfigError(
            f"{where}: unknown key(s) {unknown} for {cls.__name__} (known: {sorted(names)})"
        )
    return cls(**raw)


def _cluster_from(raw: dict, where: str) -> ClusterSpec:
    raw = dict(raw)
    nodes = []
    for i, node in enumerate(raw.pop("nodes", None) or []):
        node = dict(node)
        devices = [
            _built(DeviceGroup, d, f"{where}: nodes[{i}].devices[{j}]")
            for j, d in enumerate(node.pop("devices", None) or [])
        ]
        nodes.append(_built(NodeGroup, {**node, "devices": devices}, f"{where}: nodes[{i}]"))
    network = _built(NetworkSpec, raw.pop("network", None) or {}, f"{where}: network")
    emulation = _built(EmulationSpec, raw.pop("emulation", None) or {}, f"{where}: emulation")
    spec = _built(
        ClusterSpec,
        {**raw, "nodes": nodes, "network": network, "emulation": emulation},
        where,
    )
    resolve_cluster(spec)  # every value checked now, naming the field
    return spec


@dataclass
class HybridShardingPlan(ShardingPlan):
    """A TorchRec `ShardingPlan` (hand it to DistributedModelParallel) that also carries
    what TorchRec's cannot express."""

    batch_per_rank: list[int] = field(default_factory=list)  # feed each rank its own share
    est_step_ms: float = 0.0  # the cost model's step for this plan at these shares
    lower_bound_ms: float = 0.0  # no plan of these tables on this cluster is faster, under it
    report: Plan | None = field(default=None, repr=False)  # every table's and rank's figures

    def prepare(self, module: Any) -> Any:
        """Make `module`, the train module DistributedModelParallel will wrap, ready for
        this plan, in place, and return it: every embedding module planned at its own path
        (`check_plan_paths`), and with unequal batch shares its `loss_fn` a sum over the
        rank's samples scaled by world / global batch (`ShareWeightedLoss`), so that the
        ranks' averaged gradients are the global batch's mean, as on equal shares. The
        module must compute its loss with its `loss_fn` attribute (TorchRec's `DLRMTrain`
        does), a torch loss averaging over samples; another is refused, naming it."""
        check_plan_paths(module, self)
        if len(set(self.batch_per_rank)) <= 1:
            return module
        fn = getattr(module, "loss_fn", None)
        if not isinstance(fn, torch.nn.modules.loss._Loss) or fn.reduction != "mean":
            raise PlannerInputError(
                f"this plan gives the ranks unequal batches {self.batch_per_rank}, so each "
                f"rank's loss must be weighted by its share; {type(module).__name__}.loss_fn "
                f"is {type(fn).__name__ if fn is not None else 'missing'}, not a torch loss "
                f"averaging over samples that prepare() can rescale. Weight it yourself "
                f"(loss summed over the rank's samples x world / global batch), or plan with "
                f"equal shares"
            )
        module.loss_fn = ShareWeightedLoss(fn, len(self.batch_per_rank), sum(self.batch_per_rank))
        module.loss_reduction = "sum"  # NestedPipeline reads it: a scaled sum over samples
        return module

    def __str__(self) -> str:
        cluster = self.report.cluster if self.report else "?"
        return (
            f"hybrid plan for {cluster}: predicted {self.est_step_ms:.2f} ms/step, lower bound "
            f"{self.lower_bound_ms:.2f} ms; batch per rank {self.batch_per_rank}\n"
            + super().__str__()
        )


class ShareWeightedLoss(torch.nn.Module):
    """`loss` (a torch loss averaging over samples) summed over a rank's samples and scaled
    by world / global batch: with unequal batch shares, the ranks' averaged gradients are
    then the mean over the global batch (`HybridShardingPlan.prepare`; the project's
    trainer prices its shared batches the same way, `recsys.models.shares`)."""

    def __init__(self, loss: torch.nn.modules.loss._Loss, world: int, global_batch: int) -> None:
        super().__init__()
        self.summed = copy.copy(loss)
        self.summed.reduction = "sum"
        self.scale = world / global_batch

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.summed(logits, labels) * self.scale


class HybridPlanner:
    """Hybrid's placement and batch shares for a TorchRec model, as TorchRec's
    `EmbeddingShardingPlanner` is used: `plan(module, sharders)` on one process,
    `collective_plan(module, sharders, pg)` on every rank (planned on rank 0, broadcast).

    - `cluster`: a `ClusterSpec`, a YAML file or a preset's name (`load_cluster`).
    - `batch_size`: samples per rank a step at equal shares; the plan keeps the global
      batch (`batch_size` x ranks) and shares it by speed.
    - `access`: per-table access frequencies, an `AccessProfile` or its file (`python -m
      sharding.profile`); None: a power law of exponent `zipf_exponent` over each table.
    - `calibration`: CPU ranks' constants (a `Calibration` or its file); None: the committed
      one. GPU ranks use their kind's figures (docs/clusters.md).
    - `interaction_flops_per_sample`: the feature interaction's work beyond its parameters
      (0: none counted); `activation_bytes_per_sample`: the dense part's saved activations,
      None: estimated from the module's `Linear` layers.
    """

    def __init__(
        self,
        cluster: ClusterSpec | str | Path,
        batch_size: int,
        *,
        access: AccessProfile | str | Path | None = None,
        zipf_exponent: float = 1.05,
        calibration: Calibration | str | Path | None = None,
        precision: str = "fp32",
        storage_reservation: float = 0.15,
        interaction_flops_per_sample: float = 0.0,
        activation_bytes_per_sample: float | None = None,
        schedule: Schedule = Schedule.sparse_dist,
    ) -> None:
        self.cluster = cluster if isinstance(cluster, ClusterSpec) else load_cluster(cluster)
        if batch_size < 1:
            raise PlannerInputError(f"batch_size must be at least 1, got {batch_size}")
        self.batch_size = batch_size
        if isinstance(access, (str, Path)):
            access = AccessProfile.load(access)
        self.access = access
        self.zipf_exponent = zipf_exponent
        if isinstance(calibration, (str, Path)):
            calibration = load_calibration(Path(calibration))
        self.calibration = calibration
        self.precision = precision
        self.storage_reservation = storage_reservation
        self.interaction_flops_per_sample = interaction_flops_per_sample
        self.activation_bytes_per_sample = activation_bytes_per_sample
        self.schedule = schedule

    def plan(self, module: Any, sharders: list | None = None) -> HybridShardingPlan:
        """The plan for `module` (on any device, `meta` included); `sharders` are accepted
        for TorchRec's signature: the plan uses TorchRec's default EBC sharder's types."""
        collections = embedding_bag_collections(module)
        inputs = self._inputs(module, collections)
        plan = evaluate(hybrid(inputs, WHOLE_TABLES), inputs)
        if not plan.feasible:
            raise PlannerInputError(
                f"the tables do not fit cluster '{self.cluster.name}' whole: "
                f"{sum(t.rows * t.dim * t.weight_bytes for t in inputs.tables) / 2**30:.2f} GiB "
                f"of weights; give it more devices or memory"
            )
        split = [t.name for t in plan.tables if 0 < t.replicated_rows < t.rows or t.cold_parts > 1]
        if split:
            raise PlannerInputError(
                f"tables {split[:5]} fit only in row parts, which change the model: this "
                f"planner keeps tables whole (train with `python -m recsys.train` for split "
                f"tables)"
            )
        device_type = compute_device_type(inputs.ranks)
        return HybridShardingPlan(
            _module_plans(plan, collections, device_type),
            batch_per_rank=plan.batch_per_rank,
            est_step_ms=plan.est_step_ms,
            lower_bound_ms=plan.lower_bound_ms,
            report=plan,
        )

    def collective_plan(self, module: Any, sharders: list | None = None, pg: Any = None):
        """`plan` on rank 0 of `pg` (default: the world), the same plan on every rank; the
        process group's size must be the cluster's."""
        import torch.distributed as dist

        world = len(resolve_cluster(self.cluster))
        size = dist.get_world_size(pg)
        if size != world:
            raise PlannerInputError(
                f"the process group has {size} ranks, cluster '{self.cluster.name}' {world}: "
                f"describe the cluster the ranks run on"
            )
        made = [self.plan(module, sharders) if dist.get_rank(pg) == 0 else None]
        dist.broadcast_object_list(made, src=dist.get_global_rank(pg, 0) if pg else 0, group=pg)
        return made[0]

    def _inputs(self, module: Any, collections: dict[str, Any]) -> PlanInputs:
        from torch import nn

        tables = []
        for ebc in collections.values():
            for c in ebc.embedding_bag_configs():
                pooling = 1.0
                if self.access is not None:
                    pooling = self.access.table(c.name).lookups_per_sample
                tables.append(TableStats(c.name, c.num_embeddings, c.embedding_dim, pooling))
        names = [t.name for t in tables]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise PlannerInputError(f"table names must be unique across the model: {twice}")
        coverage = {
            t.name: self.access.table(t.name).hit_rate
            if self.access is not None
            else PowerLawCoverage(t.rows, self.zipf_exponent)
            for t in tables
        }
        embedding = {id(p) for ebc in collections.values() for p in ebc.parameters()}
        dense = [p for p in module.parameters() if id(p) not in embedding]
        linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
        activations = self.activation_bytes_per_sample
        if activations is None:  # each layer's output kept for backward, fp32
            activations = 4.0 * sum(m.out_features for m in linears)
        ranks = resolve_cluster(self.cluster)
        cpu = compute_device_type(ranks) == "cpu"
        cal = self.calibration or (load_calibration() if cpu else None)
        first = next((m for m in linears), None)
        return PlanInputs(
            tables=tables,
            coverage=coverage,
            ranks=ranks,
            devices=device_costs(ranks, cal, self.precision, self.cluster.name),
            network=network_cost(self.cluster, ranks, cal, None),
            global_batch=self.batch_size * len(ranks),
            dense_params=sum(p.numel() for p in dense),
            interaction_flops_per_sample=self.interaction_flops_per_sample,
            schedule=self.schedule,
            cpu=cpu,
            reserve=self.storage_reservation,
            cluster=self.cluster.name,
            cold_only_exchange=False,
            precision=self.precision,
            activation_bytes_per_sample=activations,
            dense_features=first.in_features if first is not None else 0,
        )


def embedding_bag_collections(module: Any) -> dict[str, Any]:
    """Every `EmbeddingBagCollection` of `module` by its module path (the keys of a
    ShardingPlan for it); none is refused: there would be nothing to shard."""
    found = {p: m for p, m in module.named_modules() if isinstance(m, EmbeddingBagCollection)}
    sequences = [p for p, m in module.named_modules() if isinstance(m, EmbeddingCollection)]
    if sequences:
        raise PlannerInputError(
            f"EmbeddingCollection modules ({sequences[:3]}) are not planned by this planner "
            f"yet; it plans EmbeddingBagCollections"
        )
    if not found:
        raise PlannerInputError(
            f"{type(module).__name__} holds no EmbeddingBagCollection: nothing to shard"
        )
    return found


def check_plan_paths(module: Any, plan: Any) -> None:
    """A ShardingPlan whose module paths are not `module`'s collections would leave tables
    unsharded without a word from DistributedModelParallel: refused, naming both."""
    embedding = (EmbeddingBagCollection, EmbeddingCollection)
    modules = dict(module.named_modules())
    keys = plan.plan if hasattr(plan, "plan") else plan
    wrong = [k for k in keys if not isinstance(modules.get(k), embedding)]
    have = [p for p, m in modules.items() if isinstance(m, embedding)]
    missing = [p for p in have if p not in keys]
    if wrong or missing:
        raise PlannerInputError(
            f"the plan's module paths {sorted(keys)} do not match the model's embedding "
            f"modules {have}: plan the model you train (DistributedModelParallel would "
            f"leave {missing or wrong} unsharded)"
        )


def _module_plans(plan: Plan, collections: dict[str, Any], device_type: str) -> dict:
    per_param, caches, row_kernels = parameter_shardings(plan, device_type)
    world = len(plan.batch_per_rank)
    nodes = [d["node"] for d in plan.devices] or [0] * world
    local = max(nodes.count(n) for n in set(nodes))
    return {
        path: module_plan(
            ebc,
            {c.name: per_param[c.name] for c in ebc.embedding_bag_configs()},
            caches,
            row_kernels,
            local_size=local,
            world_size=world,
            device_type=device_type,
        )
        for path, ebc in collections.items()
    }
