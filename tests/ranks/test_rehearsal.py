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

GPU2 = [
    "debug=tiny",
    "cluster=1x8_a100_80g",
    "cluster.nodes.0.devices.0.count=2",
    "trainer.rehearse_on_cpu=true",
]
NESTED = [
    "pipeline=nested",
    "pipeline.micro_batches=2",
    "pipeline.lookahead=true",
    "pipeline.cluster_samples=true",
]


def test_the_command_rehearses_a_gpu_run_without_a_gpu(tmp_path: Path) -> None:
    """TorchRec's plan for the two A100s (it makes one table row-wise) trains on two CPU
    ranks with no GPU; what the nested pipeline cannot do with it (dedup: row-wise owners
    send sums, not rows) is refused before building, here as it would be on the GPUs."""
    proc = run_command("recsys.train", *GPU2, f"hydra.run.dir={tmp_path / 'plain'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "plain" / "summary.json").read_text())
    assert summary["rehearsed_on_cpu"] and summary["world_size"] == 2
    assert summary["cluster"] == "1x8_a100_80g" and summary["eval_auc"] > 0.5
    # a GPU rank's input path: built ahead on a worker thread (nothing to pin on a CPU)
    assert summary["input"]["prefetch_batches"] == 2 and not summary["input"]["pinned"]
    plan = (tmp_path / "plain" / "plan.txt").read_text()
    assert "cuda:1" in plan and "row_wise" in plan  # written as the GPU run gets it
    nested = run_command(
        "recsys.train",
        *GPU2,
        *NESTED,
        "pipeline.dedup=true",
        f"hydra.run.dir={tmp_path / 'nested'}",
    )
    assert nested.returncode == 1 and "Traceback" not in nested.stderr
    assert "is sharded row_wise, whose owners send partial sums" in nested.stderr


def test_gpu_plans_train_plain_and_nested_alike(tmp_path: Path) -> None:
    """A GPU plan with split tables (hot rows replicated, hot ids counted on each rank and
    summed; here the split plan of two CPU ranks, emitted for the two GPUs) trained plain
    and nested on CPU ranks: the same losses and parameters, bit for bit."""
    pooled = ["planner=hybrid", "planner.cold_only_exchange=false"]  # nested's pooled parts
    cfgs = [to_typed(compose_config(GPU2 + pooled + extra)) for extra in ([], NESTED)]
    split = plan_with_splits(to_typed(compose_config(["debug=tiny", "planner=hybrid"])))
    assert any(0 < t.replicated_rows < t.rows for t in split.tables), "no split table"
    job = spawn_ranks(
        rank_jobs.train_variants, 2, args=(cfgs, 8, str(tmp_path), [split] * 2), timeout_s=300
    )
    for rank in raise_on_failure(job, "rehearsal"):
        plain, nested = rank["runs"]
        assert nested["losses"] == plain["losses"], rank["rank"]
        assert nested["params"].keys() == plain["params"].keys()
        differ = [
            k for k, w in plain["params"].items() if not np.array_equal(nested["params"][k], w)
        ]
        assert not differ, (rank["rank"], differ)
        assert any("_hot" in k for k in plain["params"])  # the split tables trained
    assert "cuda:0" in (tmp_path / "plan.txt").read_text()  # the plan the GPUs would get


def test_fp16_tables_train_plain_and_nested_alike(tmp_path: Path) -> None:
    """`model.table_dtype=fp16` on the rehearsed GPU plan with split tables: every table
    shard (hot copies, cold parts) stores fp16, and the nested pipeline still equals the
    plain loop bit for bit (the fused update rounds to fp16 the same way in both)."""
    pooled = ["planner=hybrid", "planner.cold_only_exchange=false", "model.table_dtype=fp16"]
    cfgs = [to_typed(compose_config(GPU2 + pooled + extra)) for extra in ([], NESTED)]
    split = plan_with_splits(to_typed(compose_config(["debug=tiny", "planner=hybrid"])))
    job = spawn_ranks(
        rank_jobs.train_variants, 2, args=(cfgs, 6, str(tmp_path), [split] * 2), timeout_s=300
    )
    for rank in raise_on_failure(job, "fp16 tables"):
        plain, nested = rank["runs"]
        tables = {k: w for k, w in plain["params"].items() if "embedding" in k and "optim" not in k}
        assert tables and all(w.dtype == np.float16 for w in tables.values()), {
            k: w.dtype for k, w in tables.items()
        }
        assert np.isfinite(plain["losses"]).all(), plain["losses"]  # replicated fp16 rows too
        assert nested["losses"] == plain["losses"], rank["rank"]
        differ = [
            k for k, w in plain["params"].items() if not np.array_equal(nested["params"][k], w)
        ]
        assert not differ, (rank["rank"], differ)
