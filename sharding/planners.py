"""Planners by name: `hybrid` (ours, `sharding.hybrid`), the simple baselines `greedy_size`
and `round_robin`, and `torchrec` (TorchRec's own, `sharding.torchrec_planner`, run from
`recsys.app.planning` because it needs the model).

The simple baselines place whole tables with equal batch shares: `round_robin` table i on
rank i mod world, `greedy_size` the largest tables first on the rank with the most free
memory; a table that does not fit its rank goes where the placer finds room (device memory,
else host memory with an HBM cache).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from sharding.batch_split import equal_batch
from sharding.hybrid import hybrid
from sharding.placer import Piece, Placer
from sharding.plan_check import check_inputs
from sharding.plan_eval import check_fits, finish_table
from sharding.types import Plan, PlanInputs, Shard, TablePlan, Tier


def _simple(inputs: PlanInputs, name: str, choose) -> Plan:
    """Whole tables, one per rank as `choose(free_hbm, table)` picks; equal batch shares."""
    check_inputs(inputs)
    check_fits(inputs)
    batch = equal_batch(inputs.global_batch, inputs.world)
    placer = Placer(inputs, batch, speed_aware=False)
    plans = []
    for i, t in enumerate(inputs.tables):
        p = Piece(t, t.rows, t.dim, 1.0, sparse_exchange=False)
        need = placer.hbm_need(p)
        r = choose(i, t, placer.free_hbm, need)
        if r is not None and placer.free_hbm[r] >= need:
            placer.free_hbm[r] -= need
            shard = Shard(t.name, r, t.rows, t.dim, Tier.hbm)
        else:
            shard = placer.place(p, inputs.coverage[t.name])
        plans.append(
            finish_table(TablePlan(t.name, t.rows, t.dim, "", [], Tier.hbm, 0, 0, [shard]))
        )
    return Plan(name, inputs.cluster, plans, batch)


def round_robin(inputs: PlanInputs) -> Plan:
    return _simple(inputs, "round_robin", lambda i, t, free, need: i % inputs.world)


def greedy_size(inputs: PlanInputs) -> Plan:
    tables = inputs.tables
    order = sorted(range(len(tables)), key=lambda i: -tables[i].rows * tables[i].dim)
    inputs_sorted = replace(inputs, tables=[inputs.tables[i] for i in order])
    plan = _simple(inputs_sorted, "greedy_size", lambda i, t, free, need: int(np.argmax(free)))
    by_name = {tp.name: tp for tp in plan.tables}
    plan.tables = [by_name[t.name] for t in inputs.tables]
    return plan


PLANNERS = {"hybrid": hybrid, "greedy_size": greedy_size, "round_robin": round_robin}
