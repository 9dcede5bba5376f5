"""Synchronous 2D sparse parallelism, planned and priced: the embedding tables sharded over
a group of G ranks, the group replicated W / G times, each replica looking up only its own
group's samples, and every replica applying the same update each step.

TorchRec 1.9's `DMPCollection` builds the groups, but keeps replicas in step by averaging
their weights and optimizer state (`sync()`, every few steps): not the plain loop's result
for Adagrad or Adam, whose state is not linear in the gradient. Kept synchronous, a step
must all-reduce across the replicas the gradient of every row any replica touched
(`pipelines.two_d` trains it so). This module prices that step with the cost model:

- within a group, the step of the plan the planner makes for G ranks (its lookups,
  exchanges, dense work and feeding, at the same batch per rank);
- its all-reduce (dense parameters and replicated hot rows) over all W ranks;
- the replica sync (`pipelines.two_d` trains it): each rank all-reduces with its replicas
  the gradients of the rows its own shards hold that the global batch touches
  (`sharding.distinct.expected_distinct` on the table's coverage curve, less the hot rows
  already in that all-reduce, spread over a table's cold rows), with the ids; a ring
  all-reduce over the W / G replicas on the all-reduce's link, priced for the group's
  busiest rank.

`benchmarks.two_d` compares that step with the planner's own plan on W ranks;
`best_with_groups` (`planner.two_d=true`) plans 2D groups and keeps them where the step
gains.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from sharding.cost_model import allreduce_s
from sharding.distinct import expected_distinct
from sharding.errors import UserError
from sharding.types import NetworkCost, Plan, PlanInputs, StepCost


def replica_sync_bytes(group_plan: Plan, group: PlanInputs, world: int) -> float:
    """Gradient bytes the busiest of a group's ranks all-reduces with its replicas per step
    (each rank syncs its own shards' rows, its replicas beside it): per shard, the rows
    the global batch of `world` ranks touches in it (hot rows excluded; the touched cold
    rows spread over a table's cold rows in proportion to each shard's), its columns, and
    an id of 8 bytes per row for the all-gather of which rows each replica touched."""
    batch = world * group.global_batch / group.world  # the same batch per rank
    stats = {t.name: t for t in group.tables}
    per_rank = [0.0] * group.world
    for tp in group_plan.tables:
        t = stats[tp.name]
        cold = t.rows - tp.replicated_rows
        if cold <= 0:
            continue
        touched = expected_distinct(group.coverage[t.name], t.rows, batch * t.lookups_per_sample)
        touched_cold = max(0.0, touched - tp.replicated_rows)
        for shard in tp.shards:
            if not shard.dp:
                rows = touched_cold * min(1.0, shard.rows / cold)
                per_rank[shard.rank] += rows * (shard.cols * t.weight_bytes + 8)
    return max(per_rank)


def two_d_cost(
    group_plan: Plan, group_cost: StepCost, group: PlanInputs, world: int, network: NetworkCost
) -> StepCost:
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
            f"trainer.sharding_group_size={size} does not divide the {world} ranks into equal "
            f"groups; choose a divisor of {world}"
        )
    for r in inputs.ranks[size:]:
        first = inputs.ranks[r.rank % size]
        if (r.kind, r.hbm_bytes, r.speed, r.host_bytes) != (
            first.kind,
            first.hbm_bytes,
            first.speed,
            first.host_bytes,
        ):
            raise TwoDGroupError(
                f"trainer.sharding_group_size={size}: rank {r.rank} ({_device(r)}) is not like "
                f"rank {first.rank} ({_device(first)}), whose shards it would hold; every group "
                f"must hold the same devices in the same order"
            )
    return replace(
        inputs,
        ranks=inputs.ranks[:size],
        devices=inputs.devices[:size],
        global_batch=inputs.global_batch * size // world,
    )


def _device(r) -> str:
    return f"{r.kind}, speed {r.speed:g}, {r.hbm_bytes / 2**30:g} GiB"


def rank_shares(plan: Plan, world: int) -> list[int]:
    """Every rank's batch under `plan` on `world` ranks: a 2D plan's split is one group's,
    the same in every group."""
    return plan.batch_per_rank * (world // len(plan.batch_per_rank))


def evaluate_two_d(plan: Plan, inputs: PlanInputs) -> Plan:
    """`plan_eval.evaluate` for a 2D plan (one group's, `plan.sharding_group_size` ranks) on
    the cluster of `inputs`: its memory and devices as the group's, its step as
    `two_d_cost` prices it, its bound the cluster's."""
    from sharding.bound import lower_bound_ms
    from sharding.cost_model import step_parts_s
    from sharding.plan_eval import evaluate, plan_cost

    group = group_inputs(inputs, plan.sharding_group_size)
    evaluate(plan, group, bound=False)
    cost = two_d_cost(plan, plan_cost(plan, group), group, inputs.world, inputs.network)
    plan.est_step_ms = 1000 * cost.step_s(inputs.schedule, inputs.micro_batches)
    parts = step_parts_s(cost, inputs.schedule, inputs.micro_batches)
    plan.step_parts_ms = {k: 1000 * v for k, v in parts.items()}
    plan.lower_bound_ms = lower_bound_ms(inputs)
    return plan


def group_sizes(inputs: PlanInputs) -> list[int]:
    """The 2D group sizes the cluster allows: divisors G < W whose groups are whole nodes
    (every group starts where a node does) and alike (`group_inputs` accepts them)."""
    starts = {r.rank for r in inputs.ranks if r.local_rank == 0}
    sizes = []
    for size in range(1, inputs.world):
        if inputs.world % size or not all(g in starts for g in range(0, inputs.world, size)):
            continue
        try:
            group_inputs(inputs, size)
        except TwoDGroupError:
            continue
        sizes.append(size)
    return sizes


def best_with_groups(plan: Plan, inputs: PlanInputs, make: Callable[[PlanInputs], Plan]) -> Plan:
    """`plan` (made for every rank) or the fastest 2D plan that fits, whichever the cost
    model prices faster: `make` plans one group of each size `group_sizes` allows."""
    best = plan
    for size in group_sizes(inputs):
        group = make(group_inputs(inputs, size))
        group.sharding_group_size = size
        evaluate_two_d(group, inputs)
        if group.feasible and (not best.feasible or group.est_step_ms < best.est_step_ms):
            best = group
    return best
