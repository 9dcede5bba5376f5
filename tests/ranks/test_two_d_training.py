"""2D groups (`trainer.sharding_group_size`, pipelines/two_d.py) against the plain loop:
4 ranks in 2 groups of 2 train what 4 ranks train with the same plan on ranks 0 and 1."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import rank_jobs
from conftest import CALIBRATION_2026_12_06, compose_config

from recsys.app.train import to_typed
from recsys.launch import raise_on_failure, spawn_ranks

STEPS = 8
SHUFFLES = 2
# per base: its overrides, and the pipelines 2D trains it under
BASES = {
    # hybrid's split tables: replicated hot rows (data-parallel), sequence cold parts
    "split tables, sequence cold parts": (
        ["planner=hybrid", "planner.cold_only_exchange=true"],
        ["plain", "sparse_dist"],
    ),
    # pooled table-wise tables (round robin over the group), bags of 0-20 ids, plain SGD
    "pooled, multi-hot, SGD": (
        [
            "planner=round_robin",
            "trainer.sparse_optimizer=sgd",
            "trainer.dense_optimizer=sgd",
            "trainer.lr=0.1",
            "trainer.embedding_lr=0.1",
            "dataset.hotness=[0,2,1,3,5,1,1,1,1,7,3,8,1,6,9,5,1,1,1,12,20,4,10,3,1,0]",
        ],
        ["plain", "sparse_dist", "fused_sparse_dist"],
    ),
}
COMMON = [
    "debug=tiny",
    "cluster=local_cpu2",
    "cluster.nodes.0.devices.0.count=4",
    "trainer.threads_per_rank=1",
]


def _group_plan(cfg):
    """The planner's plan for one group of 2 ranks; hybrid's with split tables (their CPU
    work set to zero under the pinned calibration, as `conftest.plan_with_splits`)."""
    from recsys.app.planning import make_plan, plan_inputs
    from sharding.calibration import load_calibration, without_split_work
    from sharding.two_d import group_inputs

    free = without_split_work(load_calibration(CALIBRATION_2026_12_06))
    plan = make_plan(cfg, group_inputs(plan_inputs(cfg, None, "veth_1gbit", free), 2))
    plan.sharding_group_size = 2
    return plan


def _deviations(run: dict, ref: dict) -> dict[str, float]:
    """Per tensor, its largest difference over its largest value."""
    return {
        k: float(np.abs(run["params"][k] - w).max()) / max(float(np.abs(w).max()), 1e-30)
        for k, w in ref["params"].items()
        if w.size
    }


def _deviation(run: dict, ref: dict) -> float:
    return max(_deviations(run, ref).values())


@pytest.mark.slow
def test_two_d_groups_train_what_the_plain_loop_trains(tmp_path: Path) -> None:
    """Per base: the plain loop on 4 ranks with the group's plan on ranks 0 and 1 (ranks 2
    and 3 hold no table), then 2D groups of 2 under each pipeline, then the 1D plain loop
    with each batch's samples shuffled (how far reordered sums alone go). 2D differs from
    the plain loop only in the order of each row gradient's sum, so it is held to twice
    that order noise; every pipeline under 2D equals 2D's plain loop bit for bit; the
    replicas (ranks 0 and 2, 1 and 3) hold equal shards bit for bit, every rank equal
    dense parameters; the hybrid plan does split tables."""
    cfgs, plans, starts = [], [], []
    for extra, pipelines in BASES.values():
        one_d = to_typed(compose_config(COMMON + extra))
        group = _group_plan(one_d)
        starts.append(len(cfgs))
        cfgs.append(one_d)
        plans.append(replace(group, batch_per_rank=group.batch_per_rank * 2, sharding_group_size=0))
        for p in pipelines:
            cfgs.append(
                to_typed(
                    compose_config(
                        COMMON + extra + ["trainer.sharding_group_size=2", f"pipeline={p}"]
                    )
                )
            )
            plans.append(group)
    split = plans[0]
    assert any(0 < t.replicated_rows < t.rows for t in split.tables), "no split table"
    job = spawn_ranks(
        rank_jobs.train_variants,
        4,
        args=(cfgs, STEPS, str(tmp_path), plans, False, SHUFFLES, tuple(starts)),
        timeout_s=600,
    )
    results = {r["rank"]: r["runs"] for r in raise_on_failure(job, "2D groups")}
    for b, (name, (_, pipelines)) in enumerate(BASES.items()):
        first = starts[b]
        shuffled_at = len(cfgs) + b * SHUFFLES
        for rank in range(4):
            one_d = results[rank % 2][first]
            plain_2d, *others = results[rank][first + 1 : first + 1 + len(pipelines)]
            noise = max(
                _deviation(results[rank % 2][shuffled_at + s], one_d) for s in range(SHUFFLES)
            )
            assert 0 < noise < 1e-2, (name, noise)
            assert plain_2d["params"].keys() == one_d["params"].keys(), name
            devs = _deviations(plain_2d, one_d)
            worst = max(devs, key=devs.get)
            assert devs[worst] <= 2 * noise, (
                f"{name}, rank {rank}: 2D {worst} {devs[worst]:.3g}, order noise {noise:.3g}"
            )
            np.testing.assert_allclose(
                plain_2d["losses"], results[rank][first]["losses"], rtol=1e-5
            )
            for p, run in zip(pipelines[1:], others, strict=True):
                for k, w in plain_2d["params"].items():
                    assert np.array_equal(run["params"][k], w), (name, rank, p, k)
            replica = results[(rank + 2) % 4][first + 1]
            for k, w in plain_2d["params"].items():
                assert np.array_equal(replica["params"][k], w), (name, rank, k)


@pytest.mark.slow
def test_a_2d_plan_json_trains_as_2d_groups(tmp_path: Path) -> None:
    """Hybrid's plan for groups of one rank (`trainer.sharding_group_size=1`, 2 ranks)
    written to plan.json and trained from it with no group size given: the ranks train the
    plan's groups (2 replicas of one rank's plan) and the summary and the run's plan.json say
    so. The same plan with another group size is refused before any rank starts."""
    from recsys.app.planning import SavedPlanError, make_plan, plan_inputs, plan_json
    from recsys.app.train import train

    base = ["debug=tiny", "planner=hybrid", "trainer.threads_per_rank=1"]
    cfg = to_typed(compose_config([*base, "trainer.sharding_group_size=1"]))
    plan = make_plan(cfg, plan_inputs(cfg, None, None))
    assert plan.sharding_group_size == 1 and len(plan.batch_per_rank) == 1
    saved = tmp_path / "plan.json"
    saved.write_text(json.dumps(plan_json(plan)))
    summary = train(compose_config([*base, f"trainer.plan={saved}"]), tmp_path / "run")
    assert summary["sharding_group_size"] == 1 and summary["world_size"] == 2
    assert json.loads((tmp_path / "run" / "plan.json").read_text())["sharding_group_size"] == 1
    with pytest.raises(SavedPlanError, match="is a plan for groups of 1 ranks, not 2"):
        train(
            compose_config([*base, f"trainer.plan={saved}", "trainer.sharding_group_size=2"]),
            tmp_path / "refused",
        )
