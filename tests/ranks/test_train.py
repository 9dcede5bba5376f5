"""End to end: 2-rank (and 3-rank) training through train(cfg), pipelines, resume, failures."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import rank_jobs
import torch
from conftest import CALIBRATION_2026_12_04, CONF_DIR, compose_config, plan_with_splits

from recsys.app.train import to_typed, train
from recsys.config import TrainConfigError
from recsys.launch import RankFailedError, raise_on_failure, spawn_ranks

pytestmark = pytest.mark.slow


TINY = ["debug=tiny"]
# hybrid on every rank of a cluster: where a test is about unequal batch shares, not about
# which part of the cluster hybrid would keep
EVERY_RANK = "planner.leave_out=false"


def test_two_rank_training_learns_and_writes_summary(tmp_path: Path, monkeypatch) -> None:
    """The default run learns, writes its outputs, and works out the cluster, the planner's
    inputs and the model once per process that needs them (rank_jobs.COUNTED)."""
    import recsys.app.train
    from recsys.models import cost_inputs

    cfg = compose_config(["trainer.max_steps=60", "trainer.batch_size=256", "trainer.log_every=10"])
    monkeypatch.setattr(cost_inputs, "_COSTS", {})  # this process's earlier tests' models
    in_parent = rank_jobs.count_calls(monkeypatch.setattr)
    monkeypatch.setattr(recsys.app.train, "rank_main", rank_jobs.counted_rank_main)
    summary = train(cfg, tmp_path)
    # the parent: the cluster resolved and the inputs built once (a meta model for its
    # parameter count); rank 0: the model it trains, nothing planned again
    assert in_parent == {"resolve_cluster": 1, "plan_inputs": 1, "build_model": 1}
    assert summary["calls"] == {"resolve_cluster": 0, "plan_inputs": 0, "build_model": 1}
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    for key in (
        "world_size",
        "steps",
        "samples_per_s",
        "train_loss",
        "eval_auc",
        "eval_logloss",
        "pipeline",
        "planner",
    ):
        assert key in on_disk, key
    assert on_disk["world_size"] == 2 and on_disk["steps"] == 60
    assert on_disk["pipeline"] == "plain" and on_disk["planner"] == "torchrec"
    assert on_disk["samples_per_s"] > 0 and on_disk["host_page_faults_per_step"] >= 0
    # every rank's own CPU time a timed step, gathered: each worked, none longer than the
    # step with all its threads on both cores
    step_ms = 1000 * 2 * 256 / on_disk["samples_per_s"]
    cpu = on_disk["cpu_ms_per_step_by_rank"]
    assert len(cpu) == 2 and all(0 < c < 2 * step_ms * 1.5 for c in cpu), (cpu, step_ms)
    assert on_disk["quota_throttled_share_by_rank"] is None  # no rank under a CFS quota
    assert on_disk["eval_auc"] > 0.65, "the planted model should be learnt"
    assert on_disk["eval_samples"] == 2 * 16 * 256
    losses = summary["step_losses"]
    assert len(losses) == 60 and sum(losses[-10:]) < sum(losses[:10])
    assert (tmp_path / "plan.txt").read_text().startswith("module: model.sparse_arch")
    assert len((tmp_path / "train_losses.csv").read_text().splitlines()) == 61


def test_sparse_dist_pipeline_equals_the_plain_loop(tmp_path: Path) -> None:
    """Also with its batches built 2 ahead on a worker thread (a GPU rank's default): the
    same batches, the same losses; both runs say how long input took."""
    plain = train(compose_config(TINY), tmp_path / "plain")
    sparse = train(
        compose_config(TINY + ["pipeline=sparse_dist", "trainer.prefetch_batches=2"]),
        tmp_path / "sparse",
    )
    assert sparse["pipeline"] == "sparse_dist"
    assert sparse["step_losses"] == pytest.approx(plain["step_losses"], rel=1e-6)
    assert sparse["eval_auc"] == pytest.approx(plain["eval_auc"], rel=1e-6)
    steps = plain["steps"]
    assert plain["input"]["prefetch_batches"] == 0 and plain["input"]["batches"] == steps
    # SparseDist asks for the batches ahead of its steps; the worker builds each once
    assert sparse["input"]["prefetch_batches"] == 2 and sparse["input"]["batches"] == steps
    for run in (plain, sparse):
        assert run["input"]["build_ms_per_batch"] > 0 and not run["input"]["pinned"]


def test_torchrecs_newer_exact_pipelines_equal_the_plain_loop(tmp_path: Path) -> None:
    """SparseDistLite (ids' all-to-all in the step) and FusedSparseDist (the next lookup
    under the optimizer step) use this batch's embeddings: the plain loop's losses."""
    plain = train(compose_config(TINY), tmp_path / "plain")
    for pipeline in ("sparse_dist_lite", "fused_sparse_dist"):
        other = train(compose_config(TINY + [f"pipeline={pipeline}"]), tmp_path / pipeline)
        assert other["pipeline"] == pipeline and other["steps"] == plain["steps"]
        assert other["step_losses"] == pytest.approx(plain["step_losses"], rel=1e-6), pipeline
        assert other["eval_auc"] == pytest.approx(plain["eval_auc"], rel=1e-6), pipeline


def test_the_two_tower_model_trains_under_every_pipeline(tmp_path: Path) -> None:
    """model=two_tower_small over debug=tiny's tables: the staleness-free pipelines give the
    plain loop's losses; SemiSync (one step stale, on a plan without replicated tables) trains."""
    common = TINY + ["model=two_tower_small", "trainer.eval_every=0"]
    plain = train(compose_config(common), tmp_path / "plain")
    assert plain["model"] == "two_tower_small" and all(map(math.isfinite, plain["step_losses"]))
    for pipeline in ("sparse_dist_lite", "fused_sparse_dist", "nested", "semi_sync"):
        other = train(compose_config(common + [f"pipeline={pipeline}"]), tmp_path / pipeline)
        assert other["pipeline"] == pipeline and other["steps"] == plain["steps"], pipeline
        if pipeline == "semi_sync":  # its own plan (no data-parallel tables), one step stale
            assert all(map(math.isfinite, other["step_losses"]))
        else:
            assert other["step_losses"] == pytest.approx(plain["step_losses"], rel=1e-6), pipeline


@pytest.mark.parametrize("pipeline", ["plain", "sparse_dist", "nested"])
def test_resume_from_checkpoint_gives_the_uninterrupted_losses(tmp_path: Path, pipeline) -> None:
    common = TINY + [f"pipeline={pipeline}", "trainer.max_steps=8", "trainer.eval_every=0"]
    full = train(compose_config(common), tmp_path / "full")
    first = train(
        compose_config(common + ["trainer.max_steps=4", "trainer.save_checkpoint=true"]),
        tmp_path / "first",
    )
    assert first["checkpoint"] and Path(first["checkpoint"]).name == "step_00000004"
    resumed = train(
        compose_config(common + [f"trainer.resume_from={tmp_path / 'first' / 'checkpoints'}"]),
        tmp_path / "resumed",
    )
    assert resumed["start_step"] == 4 and len(resumed["step_losses"]) == 4
    assert resumed["step_losses"] == pytest.approx(full["step_losses"][4:], rel=1e-6, abs=1e-7)
    assert resumed["eval_auc"] == pytest.approx(full["eval_auc"], rel=1e-6)
    assert resumed["eval_logloss"] == pytest.approx(full["eval_logloss"], rel=1e-6)


def test_resume_is_bit_exact_at_three_ranks(tmp_path: Path) -> None:
    """docs/training.md: the default dense reduction's buckets are fixed at start, so a
    3-rank run resumed equals the uninterrupted one (DDP rebuilds its buckets after a
    process's first step, and gloo's sums follow the buckets: `ddp_buckets` can differ in
    the last digits)."""
    common = TINY + [
        "cluster.nodes.0.devices.0.count=3",
        "trainer.max_steps=6",
        "trainer.eval_every=0",
    ]
    full = train(compose_config(common), tmp_path / "full")
    train(
        compose_config(common + ["trainer.max_steps=3", "trainer.save_checkpoint=true"]),
        tmp_path / "first",
    )
    resumed = train(
        compose_config(common + [f"trainer.resume_from={tmp_path / 'first' / 'checkpoints'}"]),
        tmp_path / "resumed",
    )
    assert resumed["step_losses"] == full["step_losses"][3:]
    assert resumed["eval_auc"] == full["eval_auc"]


PINNED = [*TINY, CALIBRATION_2026_12_04]


def test_resume_under_another_plan_works_if_tables_keep_their_kind_else_is_refused(
    tmp_path: Path,
) -> None:
    """Written against the calibration of 2026-12-04 (its TorchRec plan replicates tables
    greedy_size shards)."""
    first = train(compose_config(PINNED + ["trainer.save_checkpoint=true"]), tmp_path / "first")
    ckpt = Path(first["checkpoint"])
    saved = json.loads((ckpt / "run.json").read_text())
    assert saved["model"]["embedding_dim"] == 16 and len(saved["plan_layout"]) == 26
    resume = [f"trainer.resume_from={ckpt}", "trainer.max_steps=8"]
    # three ranks: TorchRec's tables move and are cut otherwise, DCP reshards them
    three = train(
        compose_config(PINNED + resume + ["cluster.nodes.0.devices.0.count=3"]), tmp_path / "three"
    )
    assert three["start_step"] == 6 and three["world_size"] == 3
    # greedy_size shards the tables TorchRec replicated: their optimizer state differs
    with pytest.raises(
        RankFailedError,
        match=r"was saved under another plan: table t_cat_\d+ "
        r"was data_parallel there and is sharded here",
    ):
        train(compose_config(PINNED + resume + ["planner=greedy_size"]), tmp_path / "greedy")
    # another model: one line before any rank starts
    differs = r"\(model.over_arch_layer_sizes: \[64, 32, 1\] in the checkpoint, \[32, 1\] here\)"
    with pytest.raises(TrainConfigError, match=r"the checkpoint holds another model " + differs):
        train(
            compose_config(PINNED + resume + ["model.over_arch_layer_sizes=[32,1]"]),
            tmp_path / "other_model",
        )


def test_periodic_checkpoints_are_written(tmp_path: Path) -> None:
    summary = train(compose_config(TINY + ["trainer.checkpoint_every=2"]), tmp_path)
    steps = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert steps == ["step_00000002", "step_00000004", "step_00000006"]
    assert summary["checkpoint"].endswith("step_00000006")


def test_missing_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):  # before any rank starts
        train(compose_config(TINY + [f"trainer.resume_from={tmp_path / 'nothing'}"]), tmp_path)


def test_three_ranks_train(tmp_path: Path) -> None:
    summary = train(compose_config(TINY + ["cluster.nodes.0.devices.0.count=3"]), tmp_path)
    assert summary["world_size"] == 3 and math.isfinite(summary["train_loss"])


def test_speed_skewed_cluster_pins_ranks_and_trains(tmp_path: Path) -> None:
    summary = train(compose_config(TINY + ["cluster=local_cpu3_skewed"]), tmp_path)
    assert summary["world_size"] == 3 and summary["cluster"] == "local_cpu3_skewed"


def test_unequal_shares_report_global_figures(tmp_path: Path, capfd) -> None:
    """Shares [48, 48, 96]: the progress line shows the mean loss over all ranks (what
    train_losses.csv holds), not rank 0's share of it; summary.json has no single batch per
    rank and counts the global batch."""
    cfg = TINY + [
        "cluster=local_cpu3_skewed",
        "planner=hybrid",
        "planner.leave_out=false",  # unequal shares on every rank: the point here
        "trainer.progress_bar=true",
        "trainer.log_every=3",
    ]
    summary = train(compose_config(cfg), tmp_path)
    assert summary["batch_per_rank"] == [48, 48, 96] and summary["batch_size_per_rank"] is None
    assert summary["global_batch_size"] == 192
    shown = [
        float(line.split("loss ")[1].split(",")[0])
        for line in capfd.readouterr().err.splitlines()
        if "step 6/6" in line
    ]
    losses = [
        float(x.split(",")[1]) for x in (tmp_path / "train_losses.csv").read_text().split()[1:]
    ]
    assert shown == [pytest.approx(sum(losses[3:]) / 3, abs=1e-4)], (shown, losses)


def test_samples_per_s_leaves_out_evaluation_time(tmp_path: Path) -> None:
    """Five evaluations of 0.5 s between 8 steps of ~30 ms: counted, they would cut the
    figure more than tenfold."""
    runs = {}
    for every in (0, 1):
        cfg = to_typed(
            compose_config(
                TINY
                + ["trainer.max_steps=8", f"trainer.eval_every={every}", "trainer.warmup_steps=2"]
            )
        )
        (tmp_path / str(every)).mkdir()
        job = spawn_ranks(rank_jobs.train_slow_eval, 2, args=(cfg, str(tmp_path / str(every))))
        runs[every] = raise_on_failure(job, "slow eval")[0]
    assert len(runs[1]["evals"]) == 7 and not runs[0]["evals"]
    assert runs[1]["samples_per_s"] > 0.3 * runs[0]["samples_per_s"], runs


def test_hybrid_plan_trains_and_learns(tmp_path: Path) -> None:
    cfg = compose_config(["planner=hybrid", "trainer.max_steps=60", "trainer.batch_size=256"])
    summary = train(cfg, tmp_path)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["planner"] == "hybrid" and plan["feasible"]
    assert summary["planner"] == "hybrid" and summary["eval_auc"] > 0.65


def test_a_saved_plan_trains_as_it_is(tmp_path: Path) -> None:
    """`trainer.plan`: a plan with split tables written to plan.json trains without being
    planned again; the run's plan.json is the saved one, shard for shard."""
    from recsys.app.planning import plan_json

    cfg = compose_config(TINY + ["planner=hybrid"])
    split = plan_with_splits(to_typed(cfg))
    assert any(0 < t.replicated_rows < t.rows for t in split.tables), "no split table"
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps(plan_json(split)))
    summary = train(compose_config(TINY + [f"trainer.plan={saved}"]), tmp_path / "run")
    assert summary["planner"] == "hybrid" and summary["eval_auc"] is not None
    ran = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert ran["tables"] == json.loads(saved.read_text())["tables"]
    assert [d["batch"] for d in ran["devices"]] == split.batch_per_rank


@pytest.mark.parametrize("cold_parts", [1, 2])
def test_split_tables_train_under_dmp(tmp_path: Path, cold_parts: int) -> None:
    """A plan with hot/cold split tables (cold parts as sequence embeddings, exchanged per
    lookup; or one cold part in row parts on both ranks) trains on 2 ranks through the id
    remap."""
    from dataclasses import replace

    from recsys.app.planning import run_context
    from recsys.app.train import rank_main
    from sharding.row_parts import cold_part_rows

    cfg = to_typed(
        compose_config(
            [
                "planner=hybrid",
                "planner.cold_only_exchange=true",
                "trainer.max_steps=40",
                "trainer.batch_size=256",
            ]
        )
    )
    plan = plan_with_splits(cfg)
    split = [t for t in plan.tables if 0 < t.replicated_rows < t.rows]
    assert split
    t = split[0]
    if cold_parts > 1:  # the planner cuts only cold parts too big for one rank; here by hand
        (cold,) = [s for s in t.shards if not s.dp]
        rows = cold_part_rows(cold.rows, cold_parts)
        t.shards = [s for s in t.shards if s.dp] + [
            replace(cold, rank=j % 2, rows=n, lookup_share=cold.lookup_share / cold_parts)
            for j, n in enumerate(rows)
        ]
        t.cold_parts = cold_parts
    job = spawn_ranks(rank_main, 2, args=(run_context(cfg, plan), str(tmp_path)), timeout_s=300)
    summary = raise_on_failure(job, "split training")[0]
    torchrec_plan = (tmp_path / "plan.txt").read_text()
    cold_names = [f"{t.name}_cold"] if cold_parts == 1 else [f"{t.name}_cold{j}" for j in (0, 1)]
    assert all(name in torchrec_plan for name in [f"{t.name}_hot", *cold_names])
    assert summary["eval_auc"] > 0.6 and math.isfinite(summary["train_loss"])


def test_exported_split_model_scores_as_the_sharded_one(tmp_path: Path) -> None:
    """A checkpoint of a plan with split tables (hot rows, sequence cold parts), exported
    to one unsharded model, scores every sample as the sharded model does on 2 ranks; a run
    resumed from that checkpoint under another world size keeps the saved hot ids."""
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from recsys.app.planning import plan_json
    from recsys.checkpoint import saved_split
    from recsys.export import export_checkpoint, load_exported

    cfg = compose_config(TINY + ["planner=hybrid"])
    split = plan_with_splits(to_typed(cfg))
    saved = tmp_path / "plan.json"
    saved.write_text(json.dumps(plan_json(split)))
    common = TINY + [f"trainer.plan={saved}", "planner.cold_only_exchange=true"]
    train(compose_config(common + ["trainer.save_checkpoint=true"]), tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoints"
    hot_ids, parts = saved_split(ckpt)
    assert hot_ids and all(len(ids) for ids in hot_ids.values())
    meta = export_checkpoint(ckpt, tmp_path / "export")
    assert meta["step"] == 6 and meta["model"]["table_dtype"] == "fp32"
    model, _ = load_exported(tmp_path / "export")
    names = set(model.state_dict())
    assert not any("_hot" in n or "_cold" in n for n in names)  # whole tables only

    scored = to_typed(compose_config(common + [f"trainer.resume_from={ckpt}"]))
    (tmp_path / "s").mkdir()
    job = spawn_ranks(
        rank_jobs.sharded_scores, 2, args=(scored, split, str(tmp_path / "s"), 2), timeout_s=300
    )
    results = raise_on_failure(job, "sharded scores")
    compared = 0
    with torch.no_grad():
        for r in results:
            for b in r["batches"]:
                t = {k: torch.from_numpy(v) for k, v in b.items() if k != "keys"}
                kjt = KeyedJaggedTensor(keys=b["keys"], values=t["values"], lengths=t["lengths"])
                _, (_, logits, _) = model(Batch(t["dense"], kjt, t["labels"]))
                torch.testing.assert_close(logits, t["logits"], rtol=1e-5, atol=1e-5)
                compared += len(logits)
    assert compared == 2 * 2 * 64

    # a resumed run takes the checkpoint's hot ids, not ids it counts again
    import numpy as np

    from recsys.checkpoint import SPLIT_FILE, latest_checkpoint

    rows = {t.name[len("t_") :]: t.rows for t in split.tables}
    other = {f: np.sort((ids + 1) % rows[f]) for f, ids in hot_ids.items()}  # other hot ids
    np.savez(
        latest_checkpoint(ckpt) / SPLIT_FILE,
        **other,
        **{f"{f}.parts": np.asarray(k) for f, k in parts.items()},
    )
    job = spawn_ranks(
        rank_jobs.sharded_scores, 2, args=(scored, split, str(tmp_path / "s"), 1), timeout_s=300
    )
    for r in raise_on_failure(job, "resumed split"):
        assert {f: list(v) for f, v in r["hot_ids"].items()} == {
            f: list(v) for f, v in other.items()
        }


def test_speed_aware_shares_train_on_the_skewed_cluster(tmp_path: Path) -> None:
    summary = train(
        compose_config(TINY + ["planner=hybrid", "cluster=local_cpu3_skewed", EVERY_RANK]),
        tmp_path,
    )
    shares = summary["batch_per_rank"]
    assert shares[2] > shares[0] == shares[1] and sum(shares) == 3 * 64  # the fast rank: more
    assert math.isfinite(summary["train_loss"]) and summary["eval_samples"] == 2 * sum(shares)


def test_speed_aware_shares_train_on_prepared_files(tmp_path: Path) -> None:
    """The file loader serves each rank its own batch size (a speed-aware split)."""
    from recsys.data.convert import ConvertOptions, convert
    from recsys.data.synthetic_files import SynthConfig, synthesize

    synthesize(SynthConfig(output=str(tmp_path / "tsv"), rows=8000, test_rows=0, scale=1000))
    convert(tmp_path / "tsv", tmp_path / "bin", ConvertOptions(workers=1, progress=False))
    files = ["dataset=synthetic_criteo", f"dataset.path={tmp_path / 'bin'}"]
    cfg = compose_config(TINY + ["planner=hybrid", "cluster=local_cpu3_skewed", EVERY_RANK, *files])
    summary = train(cfg, tmp_path / "run")
    shares = summary["batch_per_rank"]
    assert shares[2] > shares[0] == shares[1]
    assert math.isfinite(summary["train_loss"]) and summary["eval_samples"] == 2 * sum(shares)


def test_semi_sync_trains_torchrec_s_plan_without_replicated_tables(tmp_path: Path) -> None:
    """TorchRec's default plan replicates small tables, which SemiSync cannot train; the
    run tells its planner not to."""
    summary = train(compose_config(TINY + ["pipeline=semi_sync"]), tmp_path)
    assert summary["steps"] == 6 and math.isfinite(summary["train_loss"])
    assert "data_parallel" not in (tmp_path / "plan.txt").read_text()


def test_nan_loss_stops_the_run_naming_the_step(tmp_path: Path) -> None:
    """...and keeps what it had: a summary naming the step, the losses checked before it."""
    cfg = compose_config(TINY + ["trainer.dense_optimizer=sgd", "trainer.lr=1e30"])
    with pytest.raises(RankFailedError, match=r"train loss is (nan|inf) at step \d+") as e:
        train(cfg, tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())  # strict JSON
    bad = int(re.search(r"train loss is (?:nan|inf) at step (\d+)", summary["failed"])[1])
    assert f"kept {tmp_path / 'summary.json'}" in str(e.value)
    rows = (tmp_path / "train_losses.csv").read_text().split()[1:]
    assert [int(r.split(",")[0]) for r in rows] == list(range(1, len(rows) + 1))
    assert all(math.isfinite(float(r.split(",")[1])) for r in rows) and len(rows) < bad
    assert summary["last_good_step"] == (len(rows) or None)


def test_a_rank_that_dies_fails_the_others_in_bounded_time(tmp_path: Path) -> None:
    cfg = to_typed(compose_config(TINY + ["trainer.dist_timeout_s=20"]))
    start = time.monotonic()
    job = spawn_ranks(rank_jobs.train_rank_dies, 2, args=(cfg, str(tmp_path)), grace_s=30)
    assert time.monotonic() - start < 90
    assert job.exitcodes[1] == 17
    assert (
        "step 4 failed in a collective" in job.errors[0]
    )  # batch index 3 = 4th step  # rank 0 exits by itself, clearly
    with pytest.raises(RankFailedError, match="rank 1") as e:
        raise_on_failure(job, "training", tmp_path / "train.log")
    assert len(str(e.value).splitlines()) == 4  # a header, a line per rank, the log's path
    assert (tmp_path / "train.log").read_text().count("Traceback") == 2


def test_a_killed_rank_0_is_named_as_the_first_failure(tmp_path: Path) -> None:
    cfg = to_typed(compose_config(TINY + ["trainer.dist_timeout_s=20"]))
    job = spawn_ranks(rank_jobs.train_rank0_killed, 2, args=(cfg, str(tmp_path)), grace_s=30)
    assert job.exitcodes[0] == -9 and "failed in a collective" in job.errors[1], job.errors
    with pytest.raises(RankFailedError, match=r"\(first failure: rank 0\)"):
        raise_on_failure(job, "training", tmp_path / "train.log")


def test_a_rank_that_hangs_fails_the_others_within_the_timeout(tmp_path: Path) -> None:
    cfg = to_typed(compose_config(TINY + ["trainer.dist_timeout_s=5"]))
    start = time.monotonic()
    job = spawn_ranks(rank_jobs.train_rank_hangs, 2, args=(cfg, str(tmp_path)), grace_s=10)
    assert time.monotonic() - start < 90
    assert "failed in a collective" in job.errors[0], job.errors
    assert "dist_timeout_s=5" in job.errors[0], job.errors
    assert "killed" in job.errors[1], job.errors


def test_dry_run_plans_the_mlperf_model_without_training(tmp_path: Path) -> None:
    summary = train(compose_config(["experiment=mlperf_plan_a100"]), tmp_path)
    assert summary["dry_run"] and summary["world_size"] == 8
    assert summary["compute_device"] == "cuda"
    assert "t_cat_25" in (tmp_path / "plan.txt").read_text()


def test_torchrun_launch_runs_the_same_code(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "recsys.train",
            *TINY,
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=CONF_DIR.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 6


def test_profiled_steps_leave_a_trace_per_rank(tmp_path: Path) -> None:
    """`trainer.profile_steps=[2,3]`: each rank writes a Chrome trace of those steps, in
    which the nested pipeline's exchanges (gloo's all-to-all) and the dense matmuls both
    show; a range outside the run is refused before any rank starts."""
    summary = train(
        compose_config(TINY + ["pipeline=nested", "trainer.profile_steps=[2,3]"]), tmp_path / "run"
    )
    for rank in (0, 1):
        path = tmp_path / "run" / "traces" / f"rank{rank}.json"
        names = {e.get("name", "") for e in json.loads(path.read_text())["traceEvents"]}
        assert any("all_to_all" in n for n in names) and "aten::addmm" in names, rank
    assert summary["trace"] == str(tmp_path / "run" / "traces" / "rank0.json")
    with pytest.raises(TrainConfigError, match=r"trainer.profile_steps is \[first, last\]"):
        train(compose_config(TINY + ["trainer.profile_steps=[4,9]"]), tmp_path / "bad")


def test_tensorboard_scalars_are_the_runs_own_figures(tmp_path: Path, monkeypatch) -> None:
    """`trainer.tensorboard`: rank 0's event file holds every step's global mean loss (the
    figures train_losses.csv holds), samples/s per window and each evaluation's AUC, log
    loss and NE; asked for where tensorboard is missing, the run is refused naming the fix."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    summary = train(
        compose_config(TINY + ["trainer.eval_every=2", "trainer.tensorboard=true"]),
        tmp_path / "run",
    )
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    csv = (tmp_path / "run" / "train_losses.csv").read_text().splitlines()[1:]
    assert [s for s, _ in loss] == list(range(1, 7))
    assert [v for _, v in loss] == pytest.approx([float(r.split(",")[1]) for r in csv], rel=1e-6)
    auc = {e.step: e.value for e in events.Scalars("eval/auc")}
    assert auc[6] == pytest.approx(summary["eval_auc"], rel=1e-6)
    assert sorted(auc) == [2, 4, 6] and len(events.Scalars("eval/ne")) == 3
    assert all(e.value > 0 for e in events.Scalars("train/samples_per_s"))
    import recsys.config

    monkeypatch.setattr(recsys.config, "tensorboard_installed", lambda: False)
    with pytest.raises(TrainConfigError, match=r"tensorboard=true needs the tensorboard package"):
        train(compose_config(TINY + ["trainer.tensorboard=true"]), tmp_path / "none")


def test_a_plan_that_leaves_ranks_out_trains_on_the_rest(tmp_path: Path) -> None:
    """A plan for part of the cluster (hybrid leaving slow devices out, `plan.left_out`)
    starts only the ranks it keeps: trained as a saved plan on the whole 3-rank cluster, the
    run is on 2 ranks, at the same global batch, and its plan.json names the one left out.
    `cluster.only_ranks` trains TorchRec's planner on a part alike."""
    from recsys.app.planning import make_plan, on_part, plan_inputs, plan_json

    base = TINY + ["cluster=local_cpu3_skewed", "trainer.batch_size=32"]
    whole = to_typed(compose_config(base + ["planner=hybrid", "planner.leave_out=false"]))
    inputs = plan_inputs(whole, None, None)
    part_cfg, part = on_part(whole, inputs, [0, 2])
    plan = make_plan(part_cfg, part)
    plan.left_out = [1]
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps(plan_json(plan)))
    summary = train(compose_config(base + [f"trainer.plan={saved}"]), tmp_path / "run")
    assert summary["world_size"] == 2 and sum(summary["batch_per_rank"]) == 96
    ran = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert ran["left_out"] == [1] and ran["cluster"] == "local_cpu3_skewed@ranks_0_2"
    # the same file on a run already on that part (as torchrun would start it)
    on_part = [f"trainer.plan={saved}", "cluster.only_ranks=[0,2]", "trainer.batch_size=48"]
    on_part_run = compose_config(base + on_part)  # 96 samples on 2 ranks
    assert train(on_part_run, tmp_path / "part")["world_size"] == 2

    alone = train(
        compose_config(base + ["planner=torchrec", "cluster.only_ranks=[2]"]), tmp_path / "one"
    )
    assert alone["world_size"] == 1 and alone["eval_auc"] is not None
