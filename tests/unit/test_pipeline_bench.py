"""benchmarks.pipeline's pieces that need no network namespaces: labels, rows, the table."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.pipeline import (
    _hydra_value,
    _row_lines,
    _rows,
    _summary,
    pipeline_overrides,
    speedups,
)


def test_labels_name_the_nested_variants_and_bad_ones_fail() -> None:
    assert pipeline_overrides("sparse_dist") == ["pipeline=sparse_dist"]
    assert pipeline_overrides("nested4+dedup+cluster") == [
        "pipeline=nested",
        "pipeline.micro_batches=4",
        "pipeline.lookahead=False",
        "pipeline.cluster_samples=True",
        "pipeline.dedup=True",
    ]
    assert pipeline_overrides("nested8+dedup_fwd")[-2:] == [
        "pipeline.dedup=True",
        "pipeline.dedup_grads=False",
    ]
    for bad in ("nested4+turbo", "nested4+dedup+dedup_fwd"):
        with pytest.raises(ValueError, match="nested<N>"):
            pipeline_overrides(bad)
    assert _hydra_value("mlperf") == "mlperf" and _hydra_value([0, 2, 1]) == "[0,2,1]"


def _run(samples_per_s: float, losses: list[float]) -> dict:
    """2 ranks of 2 samples: a step takes 4000 / samples_per_s ms."""
    summary = {"samples_per_s": samples_per_s, "eval_auc": 0.7, "batch_per_rank": [2, 2]}
    return {
        "summary": summary,
        "bytes": 1e6,
        "losses": losses,
        "runs": [samples_per_s],
        "same_losses_every_round": True,
    }


def test_rows_compare_each_pipeline_with_the_plain_loop_and_sparse_dist() -> None:
    slow = {
        "plain": _run(100.0, [0.5, 0.4]),
        "sparse_dist": _run(80.0, [0.5, 0.4]),
        "nested4+dedup": _run(120.0, [0.5, 0.400001]),
    }
    fast = {k: _run(200.0, [0.5, 0.4]) for k in slow}  # 20 ms a step
    slow["nested4+dedup"]["summary"]["pipeline_stats"] = {
        "wait_ms_per_step": {"ids": 0.5, "chunks": 9.0, "gradients": 4.25, "dense_allreduce": 1}
    }
    rows = _rows(list(slow), slow, fast)
    by = {r["pipeline"]: r for r in rows}
    assert by["sparse_dist"]["bit_identical"] and by["sparse_dist"]["exposed_comm_ms"] == 30.0
    assert not by["nested4+dedup"]["bit_identical"] and by["nested4+dedup"]["equal_to_plain"]
    summary = _summary(rows)
    assert summary["speedup_vs_sparse_dist"]["nested4+dedup"] == pytest.approx(1.5)
    assert summary["plain_comm_share"] == pytest.approx(0.5)
    text = "\n".join(_row_lines(rows, summary["speedup_vs_sparse_dist"]))
    assert "| plain | 100 | 1.25x |" in text and "bit for bit (0.0e+00)" in text
    assert "| nested4+dedup | 120 | 1.50x |" in text and "yes (2.5e-06)" in text
    assert "| 0.5, 9.0, 4.2, 1.0 |" in text and "bit for bit (0.0e+00) | - |" in text


def test_a_run_without_the_plain_loop_or_semi_sync_still_makes_its_table() -> None:
    slow = {
        "sparse_dist": _run(80.0, [0.5]),
        "semi_sync": _run(100.0, [0.6]),
        "nested4": _run(120.0, [0.5]),
    }
    rows = _rows(list(slow), slow, None)
    summary = _summary(rows)
    assert summary["speedup_vs_semi_sync"]["nested4"] == pytest.approx(1.2)
    assert summary["plain_comm_share"] is None
    text = "\n".join(_row_lines(rows, summary["speedup_vs_sparse_dist"]))
    assert "| nested4 | 120 | 1.50x | 33.3 | - | 1.00 | - | - |" in text
    assert speedups({"nested4": 2.0}, "semi_sync") == {}


def test_each_set_of_runs_has_its_own_directories(tmp_path, monkeypatch) -> None:
    """The burst sweep repeats the link's own burst: its runs must not land in the main
    runs' directories (a run directory holding a finished run is refused)."""
    import contextlib

    from benchmarks import pipeline as bench

    dirs = []

    def train(overrides, steps, run_dir):
        assert not run_dir.exists()  # a fresh directory every run
        run_dir.mkdir(parents=True)
        dirs.append(run_dir)
        return 0, {"samples_per_s": 1.0}

    monkeypatch.setattr(bench, "_trainer", lambda *a: contextlib.nullcontext(train))
    monkeypatch.setattr(bench, "_losses", lambda run_dir: [])
    monkeypatch.setattr(bench, "_predicted_ms", lambda *a: None)
    cfg = bench.PipelineBenchConfig(pipelines=["plain", "sparse_dist"])
    for _ in range(2):  # the main runs, then the sweep at the same burst
        bench._train_all(cfg, None, "24kb", tmp_path, ["sparse_dist"])
    assert len(dirs) == len(set(dirs)) == 2


def test_repeated_rounds_keep_each_pipelines_median_run(tmp_path, monkeypatch) -> None:
    """`repeats`: every pipeline once a round, interleaved; each keeps its median run and
    lists every run's samples/s; a pipeline whose losses changed between rounds says so."""
    import contextlib

    from benchmarks import pipeline as bench

    speeds = iter([10.0, 5.0, 30.0, 6.0, 20.0, 7.0])  # plain, nested4 per round
    order, losses = [], {}

    def train(overrides, steps, run_dir):
        run_dir.mkdir(parents=True)
        order.append(overrides[-1])
        speed = next(speeds)
        losses[run_dir] = [0.5] if "nested" not in str(run_dir) else [0.5 + speed]
        return 0, {"samples_per_s": speed}

    monkeypatch.setattr(bench, "_trainer", lambda *a: contextlib.nullcontext(train))
    monkeypatch.setattr(bench, "_losses", lambda run_dir: losses[run_dir])
    monkeypatch.setattr(bench, "_predicted_ms", lambda *a: None)
    cfg = bench.PipelineBenchConfig()
    out = bench._train_all(cfg, None, "24kb", tmp_path, ["plain", "nested4"], repeats=3)
    assert order == ["pipeline=plain", "pipeline.dedup=False"] * 3  # interleaved rounds
    assert out["plain"]["summary"]["samples_per_s"] == 20.0
    assert out["plain"]["runs"] == [10.0, 30.0, 20.0] and out["nested4"]["runs"] == [5.0, 6.0, 7.0]
    assert out["nested4"]["summary"]["samples_per_s"] == 6.0 and out["nested4"]["losses"] == [6.5]
    assert out["plain"]["same_losses_every_round"]
    assert not out["nested4"]["same_losses_every_round"]


def test_nested_is_compared_with_the_fastest_exact_torchrec_pipeline_and_the_limit() -> None:
    """semi_sync is stale, so never the exact baseline even when fastest; the overlap limit
    is the longer of the plain loop's compute alone (fast link) and its exchange alone."""
    slow = {
        "plain": _run(100.0, [0.5]),
        "sparse_dist": _run(80.0, [0.5]),
        "fused_sparse_dist": _run(110.0, [0.5]),
        "semi_sync": _run(150.0, [0.6]),
        "nested4": _run(132.0, [0.5]),
    }
    fast = {k: _run(250.0, [0.5]) for k in slow}  # 16 ms a step: compute alone
    summary = _summary(_rows(list(slow), slow, fast))
    assert summary["best_torchrec_exact"] == {
        "pipeline": "fused_sparse_dist",
        "samples_per_s": 110.0,
    }
    assert summary["speedup_vs_best_torchrec_exact"] == {"nested4": pytest.approx(1.2)}
    assert summary["speedup_vs_best_torchrec_exact_range"] == {
        "nested4": [pytest.approx(1.2), pytest.approx(1.2)]
    }
    # the spread: each round's run against the other's run of the same round
    rows = _rows(list(slow), slow, fast)
    for r in rows:
        r["samples_per_s_runs"] = [r["samples_per_s"]] * 3
    rows[1]["samples_per_s_runs"] = [80.0, 100.0, 40.0]  # sparse_dist
    rows[4]["samples_per_s_runs"] = [132.0, 120.0, 100.0]  # nested4
    spread = _summary(rows)["speedup_vs_sparse_dist_range"]["nested4"]
    assert spread == [pytest.approx(1.2), pytest.approx(2.5)]
    # plain: 40 ms a step, 16 of them compute alone, 24 its exchange alone
    assert summary["overlap_limit_ms"] == pytest.approx(24.0)
    by = {r["pipeline"]: r for r in summary["rows"]}
    assert by["plain"]["over_overlap_limit"] == pytest.approx(40 / 24)
    assert by["nested4"]["over_overlap_limit"] == pytest.approx((4000 / 132) / 24)
    none = _summary(_rows(["nested4"], {"nested4": slow["nested4"]}, None))
    assert none["best_torchrec_exact"] is None and none["overlap_limit_ms"] is None
    assert none["speedup_vs_best_torchrec_exact"] == {}


def test_each_step_is_held_against_the_wire_and_compute_alone() -> None:
    """The physical limit: the busier direction's bytes a step at the chunked rate, or the
    plain loop's compute alone over the fast link, whichever is longer; per pipeline, from
    its own traffic (dedup sends less, so its wire time is shorter)."""
    from benchmarks.pipeline import add_wire_limits

    slow = {"plain": _run(100.0, [0.5]), "nested4": _run(200.0, [0.5])}  # 40 and 20 ms
    slow["plain"]["bytes_by_direction"] = [10e6, 8e6]  # over 10 steps: 1 MB a step
    slow["nested4"]["bytes_by_direction"] = [2e6, 3e6]  # 0.3 MB a step
    fast = {k: _run(400.0, [0.5]) for k in slow}  # 10 ms a step: compute alone
    rows = _rows(list(slow), slow, fast)
    link = {"rate_mbit": 100.0, "chunked_rate_ratio": 0.8}  # 10 MB/s
    add_wire_limits(rows, link, steps=10)
    by = {r["pipeline"]: r for r in rows}
    assert by["plain"]["wire_ms"] == pytest.approx(100.0)  # 1 MB at 10 MB/s
    assert by["plain"]["wire_limit_ms"] == pytest.approx(100.0)
    assert by["nested4"]["wire_ms"] == pytest.approx(30.0)
    assert by["nested4"]["over_wire_limit"] == pytest.approx(20.0 / 30.0)
    summary = _summary(rows)
    assert summary["over_wire_limit"] == {
        "plain": pytest.approx(0.4),
        "nested4": pytest.approx(2 / 3),
    }
    text = "\n".join(_row_lines(rows, summary["speedup_vs_sparse_dist"]))
    assert "| 0.30 | 30.0 | 0.67x |" in text
    # compute alone longer than the wire: the limit is the compute
    add_wire_limits(rows, {"rate_mbit": 8000.0, "chunked_rate_ratio": 1.0}, steps=10)
    assert by["nested4"]["wire_limit_ms"] == pytest.approx(10.0)
    # an emulated cluster's rows (no counters per direction) and no plain loop: none
    bare = _rows(["nested4"], {"nested4": _run(200.0, [0.5])}, None)
    add_wire_limits(bare, link, steps=10)
    assert "wire_limit_ms" not in bare[0] and _summary(bare)["over_wire_limit"] == {}


def test_the_row_wise_plan_is_a_second_row_set_under_plans(tmp_path, monkeypatch) -> None:
    """The second benchmark plan: each of its pipelines trained with the row-wise overrides
    after the main ones, on both links, in its own directories, without the cost model's
    prediction (a GPU plan rehearsed on CPU ranks); `plans` names both plans."""
    import contextlib

    from benchmarks import pipeline as bench

    calls = []

    def train(overrides, steps, run_dir):
        run_dir.mkdir(parents=True)
        calls.append((overrides, run_dir.name))
        speed = 100.0 if "pipeline=plain" in overrides else 150.0
        return 0, _run(speed, [0.5])["summary"]

    def no_prediction(*a):
        raise AssertionError("the row-wise set is not predicted")

    monkeypatch.setattr(bench, "_trainer", lambda *a: contextlib.nullcontext(train))
    monkeypatch.setattr(bench, "_losses", lambda run_dir: [0.5])
    monkeypatch.setattr(bench, "_predicted_ms", no_prediction)
    cfg = bench.PipelineBenchConfig()
    rows = bench._row_set(
        cfg, tmp_path, ["plain", "sparse_dist", "nested4"], tuple(cfg.row_wise), "row_wise"
    )
    assert len(calls) == 6 and all(name.endswith("_row_wise") for _, name in calls)
    for overrides, _ in calls:
        assert overrides[: len(cfg.overrides)] == cfg.overrides
        assert "planner.torchrec_sharding_types=[row_wise]" in overrides
        assert "trainer.rehearse_on_cpu=true" in overrides
    main = bench._summary(rows[:2])
    plans = bench._plans(cfg, main, rows)
    assert set(plans) == {"main", "row_wise"} and "rows" not in plans["main"]
    assert plans["row_wise"]["overrides"] == cfg.row_wise
    assert plans["row_wise"]["pipelines"] == {
        "plain": 100.0,
        "sparse_dist": 150.0,
        "nested4": 150.0,
    }
    assert plans["row_wise"]["speedup_vs_best_torchrec_exact"] == {"nested4": 1.0}
    assert set(bench._plans(replace(cfg, row_wise=None), main, None)) == {"main"}


def test_the_table_names_the_pipelines_it_could_not_run_and_why() -> None:
    """A TorchRec pipeline the benchmark cannot run here is listed with its reason, never
    dropped in silence (the published run's results, with the current list)."""
    import json

    from benchmarks import pipeline as bench
    from benchmarks.remeasure import RESULTS

    result = json.loads((RESULTS / "pipeline" / "summary.json").read_text())
    result["not_run"] = bench.NOT_RUN
    text = bench.table(result)
    assert "Not run: pec (TrainPipelinePEC trains ShardedPECEmbeddingCollection" in text
    assert "prefetch_sparse_dist (" in text and "| fused_sparse_dist |" in text
    assert "Row-wise plan (planner=torchrec" in text


def test_every_benchmark_stopped_by_ctrl_c_says_so_in_one_line(capsys) -> None:
    """Each benchmark's main runs as a command's body (benchmarks.common.benchmark_command)."""
    import re

    from benchmarks.common import benchmark_command

    @benchmark_command
    def main(cfg) -> None:
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as e:
        main(None)
    assert e.value.code == 130
    assert capsys.readouterr().err == (
        "interrupted (SIGINT): the benchmark stopped; what it saved so far is in its run "
        "directory (outputs/)\n"
    )
    mains = [
        p
        for p in (Path(__file__).parents[2] / "benchmarks").glob("*.py")
        if re.search(r"^@hydra\.main", p.read_text(), re.M)
    ]
    for p in mains:
        assert re.search(r"@hydra\.main\([^\n]*\)\n@benchmark_command\n", p.read_text()), p
