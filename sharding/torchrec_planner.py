"""Plan with TorchRec's own EmbeddingShardingPlanner, fed the cluster's per-rank memory.

TorchRec knows one speed and one bandwidth for all devices; what it can be told per rank
is capacity (`CustomTopologyData`: hbm_cap, ddr_cap). On CPU ranks the tables live in the
rank's host memory, so the rank's budget is passed as its ddr_cap.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
from torchrec.distributed.planner.types import (
    CustomTopologyData,
    KernelConfig,
    PlannerError,
    Topology,
    TopologyFactory,
    TrainerConfig,
)
from torchrec.distributed.types import ModuleSharder, ShardingPlan

from sharding.cluster import compute_device_type, local_world_size
from sharding.plan_eval import PlanDoesNotFitError
from sharding.types import PlannerConfig, RankDevice


def torchrec_topology(ranks: list[RankDevice]) -> Topology:
    """TorchRec Topology with each rank's own capacity from the cluster layout."""
    device = compute_device_type(ranks)
    world = len(ranks)
    if device == "cpu":
        caps = {"hbm_cap": [0] * world, "ddr_cap": [r.hbm_bytes for r in ranks]}
    else:
        caps = {"hbm_cap": [r.hbm_bytes for r in ranks], "ddr_cap": [r.host_bytes for r in ranks]}
    return TopologyFactory.create_topology(
        trainer_config=TrainerConfig(
            world_size=world,
            local_world_size=local_world_size(ranks),
            additional_params={"custom_topology_data": CustomTopologyData(caps, world)},
        ),
        kernel_config=KernelConfig(compute_device=device),
    )


def plan_with_torchrec(
    module: nn.Module,
    ranks: list[RankDevice],
    sharders: list[ModuleSharder[nn.Module]],
    batch_size: int,
    config: PlannerConfig,
    process_group: dist.ProcessGroup | None = None,
) -> ShardingPlan:
    """Run TorchRec's planner. With a process group, rank 0 plans and broadcasts the plan.

    `module` may (and for large models should) be built on the meta device.
    """
    planner = EmbeddingShardingPlanner(
        topology=torchrec_topology(ranks),
        batch_size=batch_size,
        storage_reservation=HeuristicalStorageReservation(percentage=config.storage_reservation),
    )
    try:
        if process_group is not None:
            return planner.collective_plan(module, sharders, process_group)
        return planner.plan(module, sharders)
    except PlannerError as e:
        budget = ", ".join(
            f"rank {r.rank} ({r.kind}): {r.hbm_bytes / 2**30:.2f} GiB" for r in ranks
        )
        raise PlanDoesNotFitError(
            f"TorchRec's planner found no plan that fits: {e.error_type.name}. Per-rank memory: "
            f"{budget}. Fix: a cluster with more memory (cluster=..., or "
            f"cluster.nodes.0.devices.0.hbm_gb=...), fewer or smaller tables (model=...), or a "
            f"smaller planner.storage_reservation. TorchRec said: {str(e).splitlines()[0]}"
        ) from e
