"""What the parent refuses before any rank starts (`recsys.preflight`): data, output
directories and the run directory, each in one line naming the key or file and the fix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CRITEO, REPO, compose_config
from support import flip_bytes, save_small_checkpoint

from recsys.app.train import to_typed, train
from recsys.config import ModelConfigError, TrainConfigError
from recsys.data.multi_hot import HotnessError
from recsys.data.prepared import CriteoDataError
from sharding.two_d import TwoDGroupError


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def test_data_errors_are_found_before_any_rank(criteo, tmp_path: Path, no_ranks) -> None:
    raw, prepared = criteo
    cases = [
        ([], CriteoDataError, r"needs dataset.path: .*output=<a new directory>"),
        ([f"dataset.path={tmp_path / 'nope'}"], CriteoDataError, r"'.*nope' is not a directory"),
        (
            [f"dataset.path={raw}"],
            CriteoDataError,
            rf"It holds Criteo text: .*input={raw} output={raw}_binary`, then pass dataset.path",
        ),
        (
            [f"dataset.path={prepared}", "trainer.batch_size=4096"],
            CriteoDataError,
            r"the train split has 1,714 rows, fewer than one batch for each rank .*smaller "
            r"trainer.batch_size",
        ),
        (
            [f"dataset.path={prepared}", "dataset.holdout_fraction=0"],
            CriteoDataError,
            r"the val split has 0 rows, .*raise dataset.holdout_fraction \(now 0; .* or set "
            r"dataset.eval_batches=0",
        ),
        (
            [f"dataset.path={prepared}", "dataset.hotness=mlperf"],
            HotnessError,
            r"_sparse_multi_hot.npz' does not exist; prepare the text again into a new directory",
        ),
    ]
    for i, (overrides, error, message) in enumerate(cases):
        with pytest.raises(error, match=message):
            train(compose_config(CRITEO + overrides), tmp_path / f"run{i}")


def test_a_truncated_array_names_its_file(criteo, tmp_path: Path, no_ranks) -> None:
    broken = _copy(criteo[1], tmp_path / "bin")
    data = (broken / "train_sparse.npy").read_bytes()
    (broken / "train_sparse.npy").write_bytes(data[: len(data) // 2])
    with pytest.raises(
        CriteoDataError,
        match=r"'.*bin/train_sparse.npy' is truncated or not a "
        r"\.npy file",
    ):
        train(compose_config(CRITEO + [f"dataset.path={broken}"]), tmp_path / "run")
    (broken / "train_sparse.npy").write_bytes(data)
    (broken / "train_labels.npy").unlink()
    with pytest.raises(CriteoDataError, match=r"train_labels.npy' is missing"):
        train(compose_config(CRITEO + [f"dataset.path={broken}"]), tmp_path / "run2")


@pytest.mark.parametrize(
    "override, error, message",
    [
        ("model.embedding_dim=6", ModelConfigError, r"model.embedding_dim=6: .*multiple of 4"),
        ("pipeline.micro_batches=0", TrainConfigError, r"pipeline.micro_batches must be >= 1"),
    ],
)
def test_kernel_and_pipeline_limits_are_one_line(tmp_path, no_ranks, override, error, message):
    with pytest.raises(error, match=message):
        train(compose_config(["debug=tiny", "pipeline=nested", override]), tmp_path)


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        (
            ["trainer.sharding_group_size=3"],
            TwoDGroupError,
            r"trainer.sharding_group_size=3 does not divide the 2 ranks into equal groups",
        ),
        (
            ["trainer.sharding_group_size=1", "pipeline=nested"],
            TrainConfigError,
            r"trainer.sharding_group_size with pipeline=nested: 2D groups train under plain",
        ),
        (
            ["planner.two_d=true"],
            TrainConfigError,
            r"planner.two_d=true is for our planners .* trainer.sharding_group_size=<G> instead",
        ),
        (
            ["trainer.sharding_group_size=1", "cluster=local_cpu3_skewed", "planner=hybrid"],
            TwoDGroupError,
            r"sharding_group_size=1: rank 2 \(cpu, speed 0.01, 0.5 GiB\) is not like "
            r"rank 0 \(cpu, speed 0.005, 0.5 GiB\)",
        ),
    ],
)
def test_2d_groups_the_cluster_or_pipeline_cannot_take_are_one_line(
    tmp_path, no_ranks, overrides, error, message
) -> None:
    with pytest.raises(error, match=message):
        train(compose_config(["debug=tiny", *overrides]), tmp_path)


def test_an_unwritable_checkpoint_dir_is_refused_before_training(tmp_path, no_ranks) -> None:
    (tmp_path / "afile").write_text("x")  # a directory under a file: unwritable even as root
    cfg = [
        "debug=tiny",
        "trainer.save_checkpoint=true",
        f"trainer.checkpoint_dir={tmp_path / 'afile' / 'ckpt'}",
    ]
    with pytest.raises(
        TrainConfigError,
        match=r"trainer.checkpoint_dir: cannot write to "
        r"'.*afile/ckpt' \(Not a directory\)",
    ):
        train(compose_config(cfg), tmp_path / "run")


def test_a_run_directory_is_one_runs(tmp_path: Path, no_ranks) -> None:
    """Held by a live run (another process holds the lock), or holding a finished run's
    summary: refused unless resuming; the other run's outputs stay as they are."""
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time; from pathlib import Path; "
                "from recsys.preflight import RunDirLock; "
                f"RunDirLock(Path({str(run)!r}), False); print('held', flush=True); time.sleep(60)"
            ),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(
            TrainConfigError,
            match=rf"'{run}' is in use by another run \(pid "
            rf"{holder.pid}\); give this run its own hydra.run.dir",
        ):
            train(compose_config(["debug=tiny", "planner=hybrid"]), run)
    finally:
        holder.kill()
        holder.wait()
    (run / "summary.json").write_text(json.dumps({"eval_auc": 0.7}))
    with pytest.raises(TrainConfigError, match="holds a finished run .* resume that run"):
        train(compose_config(["debug=tiny", "planner=hybrid"]), run)
    assert json.loads((run / "summary.json").read_text()) == {"eval_auc": 0.7}
    assert not (run / "plan.json").exists()  # refused before planning wrote anything


@pytest.mark.parametrize(
    "array, row, value, message",
    [
        ("labels", 5, 7, r"train_labels.npy' row 5: label 7, not 0 or 1 .*label_threshold"),
        ("labels", 9, -3, r"train_labels.npy' row 9: label -3, not 0 or 1"),
        ("sparse", 11, -5, r"train_sparse.npy' row 11: categorical feature 2 has id -5; ids are "),
        ("dense", 13, float("nan"), r"train_dense.npy' row 13: dense feature 2 is nan: the model "),
    ],
)
def test_labels_and_ids_no_model_can_train_on_are_refused_by_file_and_row(
    criteo, tmp_path: Path, no_ranks, array, row, value, message
) -> None:
    import numpy as np

    broken = _copy(criteo[1], tmp_path / "bin")
    values = np.load(broken / f"train_{array}.npy")
    if array == "dense":
        values = values.astype(np.float32)
    values[row, 0 if array == "labels" else 2] = value
    np.save(broken / f"train_{array}.npy", values)
    with pytest.raises(CriteoDataError, match=message):
        train(compose_config(CRITEO + [f"dataset.path={broken}"]), tmp_path / "run")


def test_ids_past_a_table_are_taken_modulo_it_and_said(criteo, tmp_path, no_ranks, caplog):
    import numpy as np

    from recsys.preflight import check_data

    broken = _copy(criteo[1], tmp_path / "bin")
    ids = np.load(broken / "train_sparse.npy").astype(np.int64)
    ids[3, 1] = 2**62
    np.save(broken / "train_sparse.npy", ids)
    cfg = to_typed(compose_config(CRITEO + [f"dataset.path={broken}"]))
    with caplog.at_level("INFO"):
        check_data(cfg, 2, None)
    assert f"cat_1: ids up to {2**62:,}" in caplog.text and "taken modulo" in caplog.text


def test_another_runs_checkpoint_dir_is_refused_before_any_rank(tmp_path: Path, no_ranks) -> None:
    ckpts = tmp_path / "theirs"
    save_small_checkpoint(ckpts, 3, run_id="their-run")
    cfg = ["debug=tiny", "trainer.save_checkpoint=true", f"trainer.checkpoint_dir={ckpts}"]
    with pytest.raises(
        TrainConfigError,
        match=rf"trainer.checkpoint_dir '{ckpts}' holds the "
        r"checkpoints of another run \(run directory unknown\); give this run its "
        rf"own trainer.checkpoint_dir, or resume that run with "
        rf"trainer.resume_from={ckpts}",
    ):
        train(compose_config(cfg), tmp_path / "run")
    assert sorted(p.name for p in ckpts.iterdir()) == [".run.lock", "step_00000003"]


def test_a_corrupt_checkpoint_is_refused_by_evaluate_and_export(tmp_path, no_ranks) -> None:
    from recsys.checkpoint import CheckpointCorruptError
    from recsys.export import export_checkpoint

    good = save_small_checkpoint(tmp_path / "ckpts", 3)
    bad = save_small_checkpoint(tmp_path / "ckpts", 6, seed=1)
    flip_bytes(bad / "__0_0.distcp")
    said = rf"checkpoint '{bad}' cannot be trusted: '.*__0_0.distcp' does not match its SHA-256"
    cfg = ["debug=tiny", "trainer.mode=evaluate", f"trainer.resume_from={tmp_path / 'ckpts'}"]
    with pytest.raises(CheckpointCorruptError, match=rf"{said}.*trainer.resume_from={good}$"):
        train(compose_config(cfg), tmp_path / "eval")
    with pytest.raises(CheckpointCorruptError, match=rf"{said}.* load it with checkpoint={good}$"):
        export_checkpoint(tmp_path / "ckpts", tmp_path / "export")
    assert not (tmp_path / "export").exists()


def test_a_checkpoint_without_run_json_is_refused_alike_everywhere(tmp_path, no_ranks) -> None:
    from recsys.export import ExportError, export_checkpoint

    ckpt = save_small_checkpoint(tmp_path / "ckpts", 3, run_file=False)
    said = (
        f"checkpoint '{ckpt}' has no run.json naming its model: resume, evaluate and "
        f"export read checkpoints that recsys.train saved (it writes one with each)"
    )
    for mode in ("train", "evaluate"):
        cfg = ["debug=tiny", f"trainer.mode={mode}", f"trainer.resume_from={ckpt}"]
        with pytest.raises(TrainConfigError) as e:
            train(compose_config(cfg), tmp_path / mode)
        assert str(e.value) == f"trainer.resume_from: {said}"
    with pytest.raises(ExportError) as e:
        export_checkpoint(ckpt, tmp_path / "export")
    assert str(e.value) == said
