"""`python -m benchmarks.scale`: a tiny grid end to end, and schedules it cannot price refused
before planning."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, run_command


@pytest.mark.slow
def test_a_tiny_grid_writes_points_validation_and_pictures(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.scale",
            "families=[homogeneous]",
            "workers=[8,16]",
            "planners=[hybrid,round_robin]",
            "schedules=[plain,sparse_dist,semi_sync,nested4,nested4+dedup]",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert len(s["points"]) == 2 * 2 * 5
    for p in s["points"]:
        assert {
            "workers",
            "schedule",
            "planner",
            "step_ms",
            "exposed_comm_ms",
            "scaling_efficiency",
            "lookup_imbalance",
        } <= set(p)
        assert 0 < p["step_ms"] and 0 <= p["exposed_comm_ms"] < p["step_ms"]
        assert 1 - 1e-9 <= p["lookup_imbalance"] < 8  # the slowest rank's lookups over the mean
    smallest = [p for p in s["points"] if p["workers"] == 8]
    assert all(p["scaling_efficiency"] == pytest.approx(1.0) for p in smallest)
    nested = {(p["workers"], p["planner"]): p for p in s["points"] if p["schedule"] == "nested4"}
    plain = {(p["workers"], p["planner"]): p for p in s["points"] if p["schedule"] == "plain"}
    assert all(nested[k]["exposed_comm_ms"] <= plain[k]["exposed_comm_ms"] for k in plain)
    # dedup's distinct ids come from the measured profile; one-hot ids repeat, so it sends less
    dedup = {
        (p["workers"], p["planner"]): p for p in s["points"] if p["schedule"].endswith("dedup")
    }
    assert all(p["dedup_counts"] == "measured" for p in dedup.values())
    assert all(dedup[k]["exposed_comm_ms"] <= nested[k]["exposed_comm_ms"] for k in nested)
    v = s["validation"]
    assert len(v) >= 10 and {"setting", "predicted_ms", "measured_ms", "rel_error"} <= set(v[0])
    # the calibration's settings priced at the cores' speed measured beside each
    cal = json.loads((REPO / "benchmarks/results/calibrate/summary.json").read_text())
    speeds = {c["setting"]: c.get("cores_speed", 1.0) for c in cal["validation"]}
    assert {r["setting"]: r["cores_speed"] for r in v if r["setting"] in speeds} == speeds
    ratios = [r for r in v if "measured_link_ratio" in r]  # the dedup runs: volume vs bytes
    assert ratios and all(0 < r["predicted_volume_ratio"] < 1 for r in ratios)
    exact = sorted(abs(r["rel_error"]) for r in v if not r["dedup"])
    assert len(exact) < len(v)
    assert s["median_abs_error_without_dedup"] == pytest.approx(float(np.median(exact)))
    assert s["median_abs_error"] == pytest.approx(
        float(np.median([abs(r["rel_error"]) for r in v]))
    )
    for png in ("scaling.png", "timeline.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"


def test_schedules_the_profile_cannot_price_are_refused_before_planning(tmp_path: Path) -> None:
    for args, says in (
        (["profile=null"], "counted after clustering"),
        (["schedules=[plain+dedup]"], "only nested"),
    ):
        proc = run_command("benchmarks.scale", *args, f"hydra.run.dir={tmp_path}")
        assert proc.returncode != 0 and says in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and "planned" not in proc.stdout
