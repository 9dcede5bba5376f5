"""What a training run checks before any rank starts (one line naming the key), in one
process."""

from __future__ import annotations

import io
import json
import os
from dataclasses import asdict

import pytest
from conftest import CALIBRATION_2026_12_04, REPO
from omegaconf import OmegaConf
from support import save_small_checkpoint

from recsys.app.train import train
from recsys.config import TrainConfigError, check_train_config, register_configs


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.batch_size=0", "trainer.batch_size must be >= 1, got 0"),
        ("trainer.max_steps=0", "trainer.max_steps must be >= 1, got 0"),
        ("trainer.warmup_steps=-1", "trainer.warmup_steps must be >= 0, got -1"),
        ("trainer.log_every=0", "trainer.log_every must be >= 1, got 0"),
        ("trainer.prefetch_batches=-1", "trainer.prefetch_batches must be >= 0, got -1"),
        ("trainer.lr=nan", "trainer.lr must be a finite number > 0, got nan"),
        ("trainer.lr=-0.1", "trainer.lr must be a finite number > 0, got -0.1"),
        ("trainer.embedding_lr=inf", "trainer.embedding_lr must be a finite number > 0, got inf"),
        ("trainer.dist_timeout_s=0", "trainer.dist_timeout_s must be a finite number > 0"),
        ("trainer.job_timeout_s=-5", "trainer.job_timeout_s must be a finite number > 0"),
        ("dataset.eval_batches=-1", "dataset.eval_batches must be >= 0"),
        ("dataset.eval_batches=null", "needs prepared files: synthetic data has no end"),
        ("trainer.mode=evaluate", "trainer.mode=evaluate needs trainer.resume_from=<a checkpoint"),
        ("trainer.log_level=verbose", "trainer.log_level must be info or debug, got 'verbose'"),
    ],
)
def test_bad_trainer_values_are_refused_naming_the_key(typed_cfg, override, message) -> None:
    with pytest.raises(TrainConfigError, match=message.replace("(", r"\(")):
        check_train_config(typed_cfg([override]))


def test_resuming_past_max_steps_is_refused_before_any_rank_starts(typed_cfg, tmp_path) -> None:
    cfg = typed_cfg([f"trainer.resume_from={tmp_path / 'checkpoints'}", "trainer.max_steps=5"])
    model = json.loads(json.dumps(asdict(cfg.model)))
    save_small_checkpoint(tmp_path / "checkpoints", 10, model_config=model)
    with pytest.raises(
        TrainConfigError, match="checkpoint is at step 10, at or past trainer.max_steps=5"
    ):
        train(cfg, tmp_path / "run")


def test_a_model_larger_than_the_cluster_is_one_message_before_any_rank(
    typed_cfg, tmp_path, no_ranks
) -> None:
    from sharding.types import PlanDoesNotFitError

    with pytest.raises(
        PlanDoesNotFitError,
        match=r"the tables need 98\.12 GiB .* offers 0\.10 "
        r"GiB .* trainer\.dry_run=true cluster=<a GPU layout",
    ):
        train(typed_cfg(["model=dcnv2_mlperf"]), tmp_path)


def test_semi_sync_refuses_a_plan_with_replicated_rows_before_any_rank(
    typed_cfg, tmp_path, no_ranks
) -> None:
    with pytest.raises(
        TrainConfigError,
        match=r"pipeline=semi_sync cannot train the hybrid "
        r"plan: it replicates rows of t_cat_\d+",
    ):
        train(typed_cfg(["pipeline=semi_sync", "planner=hybrid"]), tmp_path)


def test_a_gpu_cluster_on_a_machine_without_cuda_is_one_line(typed_cfg, tmp_path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(
        TrainConfigError,
        match="has GPUs and this machine has no CUDA: plan it "
        "with `python -m sharding.plan cluster=1x8_a100_80g`",
    ):
        train(typed_cfg(["cluster=1x8_a100_80g"]), tmp_path)


def test_run_directories_of_one_second_differ() -> None:
    """Hydra's run dir carries the process id beside the time."""
    text = (REPO / "conf" / "config.yaml").read_text()
    assert "${now:%Y-%m-%d_%H-%M-%S}-${pid:}" in text
    register_configs()
    assert OmegaConf.create({"d": "runs/x-${pid:}"}).d == f"runs/x-{os.getpid()}"


def test_a_training_benchmark_on_an_emulated_cluster_publishes_beside_the_default() -> None:
    from types import SimpleNamespace

    from benchmarks.common import results_dir_for

    results = REPO / "benchmarks" / "results"
    assert results_dir_for("plan_train", None) == str(results / "plan_train")
    emulated = SimpleNamespace(name="emu_mixed4")
    assert results_dir_for("pipeline", emulated) == str(results / "pipeline_emu_mixed4")


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [False, True])
def test_progress_is_a_bar_on_a_terminal_and_plain_lines_elsewhere(tty: bool) -> None:
    from recsys.progress import Progress

    stream = _Stream(tty)
    bar = Progress(20, 0, "train plain x2", enabled=True, stream=stream, loss=True)
    for step in range(20):
        bar.set_postfix(loss=f"{0.5 + step / 100:.4f}")
        bar.update(1)
    bar.close()
    text = stream.getvalue()
    if tty:
        assert "\r" in text and "20/20" in text
    else:
        lines = text.splitlines()
        # the first step (the work has started), then one line every tenth of the run
        assert "\r" not in text and len(lines) == 11
        assert lines[0].startswith("train plain x2: step 1/20 (5%), loss 0.5000, ")
        assert lines[1].startswith("train plain x2: step 2/20 (10%), loss 0.5100, ")
        assert lines[-1].startswith("train plain x2: step 20/20 (100%), loss 0.6900, ")


def test_a_plan_that_follows_the_pipeline_is_said_to(typed_cfg, tmp_path, caplog) -> None:
    """Hybrid prices the pipeline's schedule: on the skewed cluster (4 ranks; at 3 the
    calibration of 2026-12-04 gives both the same plan) nested gets another plan than the
    plain loop, and the run says so (its losses then differ from a plain run's)."""
    import logging

    from recsys.app.planning import plan_inputs
    from recsys.app.train import plan_ours

    base = [
        "debug=tiny",
        "cluster=local_cpu3_skewed",
        "cluster.nodes.0.devices.0.count=3",
        "planner=hybrid",
        "planner.leave_out=false",  # every rank: the placement's schedule is the point
        CALIBRATION_2026_12_04,
    ]
    with caplog.at_level(logging.INFO, logger="recsys.app.train"):
        for overrides in (base, [*base, "pipeline=nested"]):
            cfg = typed_cfg(overrides)
            plan_ours(cfg, plan_inputs(cfg, None, None), tmp_path)
            if overrides == base:
                assert "priced" not in caplog.text  # the plain loop: nothing to compare
    assert (
        "planner=hybrid priced pipeline=nested's schedule: its plan differs from the plain "
        "loop's (" in caplog.text
    )
