"""`trainer.rehearse_on_cpu`: a GPU cluster's plan, made and checked for its GPUs, trained on
as many CPU ranks (docs/gpus.md): the command with no GPU, TorchRec's plan and ours with
split tables, plain and nested bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import rank_jobs
from conftest import compose_config, plan_with_splits, run_command

from recsys.app.train import to_typed
from recsys.launch import raise_on_failure, spawn_ranks

pytestmark = pytest.mark.slow

GPU2 = ["debug=tiny", "cluster=1x8_a100_80g", "cluster.nodes.0.devices.0.count=2",
        "trainer.rehearse_on_cpu=true", "planner.torchrec_timeout_s=2"]  # fmt: skip
NESTED = ["pipeline=nested", "pipeline.micro_batches=2", "pipeline.lookahead=true",
          "pipeline.cluster_samples=true"]  # fmt: skip


def test_the_command_rehearses_a_gpu_run_without_a_gpu(tmp_path: Path) -> None:
    proc = run_command("recsys.train", *GPU2, *NESTED, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["rehearsed_on_cpu"] and summary["world_size"] == 2
    assert summary["pipeline"] == "nested" and summary["cluster"] == "1x8_a100_80g"
    # a GPU rank's input path: built ahead on a worker thread (nothing to pin on a CPU)
    assert summary["input"]["prefetch_batches"] == 2 and not summary["input"]["pinned"]
    plan = (tmp_path / "plan.txt").read_text()
    assert "cuda" in plan and "/cpu" not in plan  # written as the GPU run gets it


def test_gpu_plans_of_torchrec_and_ours_train_plain_and_nested_alike(tmp_path: Path) -> None:
    """TorchRec's plan (planned on rank 0 for the GPUs and broadcast) and our hybrid plan
    with split tables (hot ids counted and summed across ranks), each trained plain and
    nested: the same losses and parameters, bit for bit."""
    torchrec = [to_typed(compose_config(GPU2 + extra)) for extra in ([], NESTED)]
    hybrid = [to_typed(compose_config(GPU2 + ["planner=hybrid"] + extra)) for extra in ([], NESTED)]
    split = plan_with_splits(hybrid[0])
    assert any(0 < t.replicated_rows < t.rows for t in split.tables), "no split table"
    job = spawn_ranks(rank_jobs.train_variants, 2,
                      args=(torchrec + hybrid, 8, str(tmp_path), [None, None, split, split]),
                      timeout_s=300)  # fmt: skip
    for rank in raise_on_failure(job, "rehearsal"):
        runs = rank["runs"]
        for plain, nested in ((runs[0], runs[1]), (runs[2], runs[3])):
            assert nested["losses"] == plain["losses"], rank["rank"]
            assert nested["params"].keys() == plain["params"].keys()
            differ = [k for k, w in plain["params"].items()
                      if not np.array_equal(nested["params"][k], w)]  # fmt: skip
            assert not differ, (rank["rank"], differ)
        assert any("_hot" in k for k in runs[2]["params"])  # the split tables trained
