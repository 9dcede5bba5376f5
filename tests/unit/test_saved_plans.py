"""`trainer.plan`: a plan.json read back is the plan that was written, shard for shard, and
one made for another model, cluster, world or batch is refused in one line naming it."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from recsys.app.planning import SavedPlanError, load_plan, make_plan, plan_inputs, plan_json
from recsys.app.train import train

HYBRID = ["debug=tiny", "planner=hybrid", "trainer.batch_size=2048"]


def _saved(typed_cfg, tmp_path: Path, overrides: list[str]) -> tuple[Path, object]:
    cfg = typed_cfg(overrides)
    plan = make_plan(cfg, plan_inputs(cfg, None, None))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_json(plan), indent=1))
    return path, plan


def test_a_saved_plan_reads_back_shard_for_shard(typed_cfg, tmp_path: Path) -> None:
    path, plan = _saved(typed_cfg, tmp_path, HYBRID)
    cfg = typed_cfg(HYBRID)
    loaded = load_plan(str(path), plan_inputs(cfg, None, None))
    assert [asdict(t) for t in loaded.tables] == [asdict(t) for t in plan.tables]
    assert loaded.batch_per_rank == plan.batch_per_rank and loaded.planner == "hybrid"
    assert loaded.est_step_ms == pytest.approx(plan.est_step_ms)


def test_torchrecs_saved_plan_reads_back_as_its_placement(typed_cfg, tmp_path: Path) -> None:
    """TorchRec's plan, saved, trains as it is (its placement, at the saved batch split):
    what `benchmarks.plan_train`'s `torchrec+hybrid_split` trains."""
    overrides = ["debug=tiny", "planner=torchrec", "trainer.batch_size=2048"]
    path, plan = _saved(typed_cfg, tmp_path, overrides)
    loaded = load_plan(str(path), plan_inputs(typed_cfg(overrides), None, None))
    assert [asdict(t) for t in loaded.tables] == [asdict(t) for t in plan.tables]
    assert loaded.planner == "torchrec" and loaded.batch_per_rank == plan.batch_per_rank


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "cluster=local_cpu3_skewed",
            "was made for cluster 'local_cpu2' with 2 ranks; this run is on "
            "'local_cpu3_skewed' with 3",
        ),
        ("model.embedding_dim=32", "holds another model's tables (first difference: t_cat_0"),
        (
            "trainer.batch_size=1024",
            "splits a global batch of 4096 samples; this run's is 2048 "
            "(trainer.batch_size x ranks): set trainer.batch_size=2048",
        ),
    ],
)
def test_a_plan_for_something_else_is_refused_naming_it(typed_cfg, tmp_path, override, message):
    path, _ = _saved(typed_cfg, tmp_path, HYBRID)
    cfg = typed_cfg(
        HYBRID + [override, "model.dense_arch_layer_sizes=[64,32]"]
        if override.startswith("model")
        else HYBRID + [override]
    )
    with pytest.raises(SavedPlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_plan(str(path), plan_inputs(cfg, None, None))


def test_files_that_are_no_plan_of_ours_are_refused(typed_cfg, tmp_path: Path) -> None:
    inputs = plan_inputs(typed_cfg(HYBRID), None, None)
    with pytest.raises(SavedPlanError, match="no file"):
        load_plan(str(tmp_path / "nowhere.json"), inputs)
    (tmp_path / "bad.json").write_text('{"planner": "hybrid"}')
    with pytest.raises(SavedPlanError, match="is not a plan.json of this version"):
        load_plan(str(tmp_path / "bad.json"), inputs)


def test_a_wrong_saved_plan_stops_the_run_before_any_rank(typed_cfg, tmp_path, no_ranks) -> None:
    path, _ = _saved(typed_cfg, tmp_path, HYBRID)
    with pytest.raises(SavedPlanError, match="holds another model's tables"):
        train(
            typed_cfg(
                [
                    "debug=tiny",
                    f"trainer.plan={path}",
                    "model.embedding_dim=32",
                    "model.dense_arch_layer_sizes=[64,32]",
                ]
            ),
            tmp_path / "run",
        )
