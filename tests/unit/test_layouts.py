"""Layouts generated from a seed (sharding.layouts): valid clusters of the drawn shapes."""

from __future__ import annotations

import numpy as np

from sharding.cluster import resolve_cluster
from sharding.layouts import random_layout


def test_layouts_span_sizes_kinds_and_links_and_resolve() -> None:
    sizes, kinds, unequal = [], [], 0
    for seed in range(40):
        spec = random_layout(seed, max_ranks=512)
        assert spec == random_layout(seed, max_ranks=512)  # the seed alone decides
        ranks = resolve_cluster(spec)
        assert 1 <= len(ranks) <= 512
        assert 10 <= spec.network.inter_node_gbit_s <= 400
        sizes.append(len(ranks))
        kinds.append(len({r.kind for r in ranks}))
        per_node = np.bincount([r.node for r in ranks])
        unequal += len(set(per_node.tolist())) > 1
    assert min(sizes) < 8 and max(sizes) > 128
    assert min(kinds) == 1 and max(kinds) >= 5
    assert unequal >= 10  # nodes of unequal sizes, as presets rarely have


def test_hybrid_plans_small_generated_layouts() -> None:
    from test_planners import inputs_for

    from sharding.plan_eval import evaluate
    from sharding.planners import PLANNERS
    from sharding.types import TableStats

    tables = [TableStats(f"t{i}", 10_000 * (i + 1), 64, 1.0 + i) for i in range(8)]
    small = [s for s in range(40) if len(resolve_cluster(random_layout(s, 32))) <= 16][:4]
    for seed in small:
        inputs = inputs_for(random_layout(seed, 32), tables, batch=512)
        plan = evaluate(PLANNERS["hybrid"](inputs), inputs)
        assert plan.feasible and plan.est_step_ms >= plan.lower_bound_ms * (1 - 1e-9)
