"""Synchronous 2D sparse parallelism, priced: the embedding tables sharded over a group of G
ranks, the group replicated W / G times, each replica looking up only its own group's
samples, and every replica applying the same update each step.

TorchRec 1.9's `DMPCollection` builds the groups, but keeps replicas in step by averaging
their weights and optimizer state (`sync()`, every few steps): not the plain loop's result
for Adagrad or Adam, whose state is not linear in the gradient. Kept synchronous, a step
must all-reduce across the replicas the gradient of every row any replica touched. This
module prices that step with the cost model, generously to 2D:

- within a group, the step of the plan the planner makes for G ranks (its lookups,
  exchanges, dense work and feeding, at the same batch per rank);
- its all-reduce (dense parameters and replicated hot rows) over all W ranks;
- the replica sync: per table, the distinct rows the global batch touches
  (`sharding.distinct.expected_distinct` on the table's coverage curve) less the hot rows
  already in that all-reduce, spread evenly over the group's G ranks, one ring all-reduce
  over the W / G replicas on the all-reduce's link. No placement sends less than the rows
  it must agree on, and a real one is never this even.

`benchmarks.two_d` compares that step with the planner's own plan on W ranks.
"""

from __future__ import annotations

from dataclasses import replace

from sharding.cost_model import allreduce_s
from sharding.distinct import expected_distinct
from sharding.errors import UserError
from sharding.types import NetworkCost, Plan, PlanInputs, StepCost


def replica_sync_bytes(group_plan: Plan, group: PlanInputs, world: int) -> float:
    """Gradient bytes each of a group's ranks all-reduces with its replicas per step: the
    rows the global batch of `world` ranks touches (hot rows excluded), evenly over the
    group's ranks."""
    batch = world * group.global_batch / group.world  # the same batch per rank
    hot = {t.name: t.replicated_rows for t in group_plan.tables}
    total = 0.0
    for t in group.tables:
        touched = expected_distinct(group.coverage[t.name], t.rows, batch * t.lookups_per_sample)
        total += max(0.0, touched - hot.get(t.name, 0)) * t.dim * t.weight_bytes
    return total / group.world


def two_d_cost(group_plan: Plan, group_cost: StepCost, group: PlanInputs, world: int,
               network: NetworkCost) -> StepCost:  # fmt: skip
    """The per-rank stage times of one 2D step on `world` ranks (`network`: the whole
    cluster's): the group's stages, with its all-reduce over every rank and the replica
    sync after it."""
    if world % group.world:
        raise ValueError(f"2D groups of {group.world} ranks do not divide {world} ranks")
    sync = replica_sync_bytes(group_plan, group, world)
    return replace(
        group_cost,
        allreduce_s=allreduce_s(group_cost.allreduce_bytes, world, network)
        + allreduce_s(sync, world // group.world, network),
        allreduce_link="nic",
    )


class TwoDGroupError(UserError, ValueError):
    """2D groups that do not divide the cluster into alike groups."""


def group_inputs(inputs: PlanInputs, size: int) -> PlanInputs:
    """The planner's inputs for one 2D group: the first `size` ranks (the other groups must
    hold the same devices in the same places) at the same batch per rank."""
    world = inputs.world
    if size <= 0 or size == world:
        return inputs
    if size > world or world % size:
        raise TwoDGroupError(
            f"trainer.sharding_group_size={size} does not divide the {world} ranks into equal groups; "
            f"choose a divisor of {world}"
        )
    for r in inputs.ranks[size:]:
        first = inputs.ranks[r.rank % size]
        if (r.kind, r.hbm_bytes, r.speed, r.host_bytes) != \
                (first.kind, first.hbm_bytes, first.speed, first.host_bytes):  # fmt: skip
            raise TwoDGroupError(
                f"trainer.sharding_group_size={size}: rank {r.rank} ({r.kind}) is not like rank "
                f"{first.rank} ({first.kind}), whose shards it would hold; every group must hold "
                f"the same devices in the same order"
            )
    return replace(inputs, ranks=inputs.ranks[:size], devices=inputs.devices[:size],
                   global_batch=inputs.global_batch * size // world)  # fmt: skip


def rank_shares(plan: Plan, world: int) -> list[int]:
    """Every rank's batch under `plan` on `world` ranks: a 2D plan's split is one group's,
    the same in every group."""
    return plan.batch_per_rank * (world // len(plan.batch_per_rank))
