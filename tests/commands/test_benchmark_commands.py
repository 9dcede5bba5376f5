"""The benchmark commands end to end on small settings: the planner benchmark writes the names
the checks rely on; a benchmark updates the published results only with `save=true`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_command

PROFILE = REPO / "benchmarks" / "results" / "planners" / "profile_mlperf_synthetic.json"


@pytest.mark.slow
def test_a_small_benchmark_run_writes_the_names_checks_rely_on(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.planners",
            "clusters=[hetero_3node]",
            "at_scale=false",
            "grid.cells=4",
            "grid.clusters=[hetero_3node,1x8_a100_80g]",
            "grid.layouts=0",
            "grid.torchrec_timeout_s=5",
            f"grid.profile={PROFILE}",
            f"results_dir={tmp_path}",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "summary.json").exists()  # published results only with save=true
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    p = s["presets"]["hetero_3node"]
    assert p["hybrid_ms"] < p["torchrec_ms"]  # the mixed preset: speed shares alone pay
    assert p["lower_bound_ms"] <= p["hybrid_ms"]
    assert p["torchrec_own_best_ms"] >= p["torchrec_ms"]  # the best rated, by definition
    steps = [d["step"] for d in p["decomposition"]]
    assert steps[0] == "torchrec" and steps[-1] == "+row_parts"
    assert p["decomposition"][-1]["ms"] == pytest.approx(p["hybrid_ms"])
    cells = s["grid"]["cells"]
    assert len({(c["suite"], c["cluster"]) for c in cells}) == 4
    assert {c["planner"] for c in cells} == {
        "hybrid",
        "torchrec",
        "torchrec_own",
        "greedy_size",
        "round_robin",
    }
    assert set(s["grid"]["wins"]) == {c["planner"] for c in cells}
    assert isinstance(s["grid"]["hybrid_losses"], list)
    run = tmp_path / "run"
    assert (run / "grid.csv").read_text().count("\n") == len(cells) + 1
    assert (run / "grid.png").stat().st_size > 10_000
    assert (run / "planner_gains.png").stat().st_size > 10_000
    assert "## Grid: 4 cells" in (run / "planners.md").read_text()


def test_benchmarks_update_the_published_results_only_with_save(tmp_path: Path) -> None:
    args = [
        "rows=6000",
        "batch_size=256",
        "epochs=1",
        "workers=[1]",
        f"results_dir={tmp_path / 'published'}",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.data", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "run" / "data.json").exists() and (tmp_path / "run" / "data.md").exists()
    assert not (tmp_path / "published").exists()
    assert "save=true also writes them to" in proc.stdout
    proc = run_command("benchmarks.data", *args, "save=true")  # the same, in this process
    assert proc.returncode == 0, proc.stderr[-3000:]
    published = json.loads((tmp_path / "published" / "data.json").read_text())
    assert published == json.loads((tmp_path / "run" / "data.json").read_text())


def test_two_d_prices_each_group_against_hybrids_plan(tmp_path: Path) -> None:
    """Each group size that divides the cluster into whole nodes is priced beside hybrid's
    plan; smaller groups sync more rows with more replicas; a stale schedule is refused."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    base = [
        sys.executable,
        "-m",
        "benchmarks.two_d",
        "workers=[32]",
        "groups=[8,12,16,32]",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    proc = subprocess.run(
        [*base, "schedules=[sparse_dist,nested2]"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    (hybrid,) = s["hybrid"]
    assert [p["group"] for p in s["points"]] == [8, 16]  # 12: not whole nodes; 32: all of it
    eight, sixteen = s["points"]
    assert eight["sync_mb_per_rank"] > sixteen["sync_mb_per_rank"] > 0
    for p in s["points"]:
        assert p["vs_hybrid"] == pytest.approx(hybrid["step_ms"] / p["step_ms"])
        assert p["schedule"] in ("sparse_dist", "nested2")
    stale = subprocess.run(
        [*base, "schedules=[semi_sync]"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert stale.returncode != 0 and "must be exact" in stale.stderr
