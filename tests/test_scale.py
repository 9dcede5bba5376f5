"""The scale study: a tiny grid end to end, and its validation against measured runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.scale import Family, ScaleConfig, ScheduleLabel, cluster_at, schedule_of_label
from sharding.types import Schedule

REPO = Path(__file__).resolve().parents[1]


def test_families_scale_their_base_preset_and_divide_the_network() -> None:
    from recsys.config import register_configs

    register_configs()
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        compose(config_name="config")  # a Hydra context for the family builder
        cfg = compose(config_name="bench_scale")  # the families config group's defaults
        families = {k: Family(**v) for k, v in cfg.families.items()}
        assert list(families) == ["homogeneous", "mixed"]
        h = cluster_at("homogeneous", families["homogeneous"], 64, 2.0)
        assert sum(n.count * sum(d.count for d in n.devices) for n in h.nodes) == 64
        assert h.network.inter_node_gbps == 200  # 2x8_h100's 400, oversubscribed 2:1
        m = cluster_at("mixed", families["mixed"], 128, 1.0)
        assert [n.count for n in m.nodes] == [4, 4, 4, 4]  # hetero_64's 2 of each, twice
        assert cluster_at("mixed", families["mixed"], 96, 1.0) is None  # not a multiple of 64
        halves = cluster_at("mixed", Family("hetero_64", 32), 96, 1.0)  # a node of each kind
        assert [n.count for n in halves.nodes] == [3, 3, 3, 3]
        with pytest.raises(SystemExit, match="families.odd.step such that"):
            cluster_at("odd", Family("hetero_64", 16), 64, 1.0)  # half a node of each kind
    assert schedule_of_label("nested8") == ScheduleLabel(Schedule.nested, 8)
    assert schedule_of_label("sparse_dist") == ScheduleLabel(Schedule.sparse_dist, 1)
    assert schedule_of_label("semi_sync") == ScheduleLabel(Schedule.sparse_dist, 1, stale=True)
    assert schedule_of_label("base") == ScheduleLabel(Schedule.plain)  # TorchRec's, no overlap
    both = schedule_of_label("nested2+dedup+cluster")
    assert (both.micro_batches, both.dedup, both.clustered) == (2, True, True)
    for bad in ("plain+dedup", "nested4+fast"):
        with pytest.raises(ValueError, match="only nested"):
            schedule_of_label(bad)
    assert ScaleConfig().workers[-1] == 1536


@pytest.mark.slow
def test_a_tiny_grid_writes_points_validation_and_pictures(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.scale", "families=[homogeneous]",
                           "workers=[8,16]", "planners=[hybrid,round_robin]",
                           "schedules=[plain,sparse_dist,semi_sync,nested4,nested4+dedup]",
                           f"hydra.run.dir={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert len(s["points"]) == 2 * 2 * 5
    for p in s["points"]:
        assert {"workers", "schedule", "planner", "step_ms", "exposed_comm_ms",
                "scaling_efficiency"} <= set(p)  # fmt: skip
        assert 0 < p["step_ms"] and 0 <= p["exposed_comm_ms"] < p["step_ms"]
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
    ratios = [r for r in v if "measured_link_ratio" in r]  # the dedup runs: volume vs bytes
    assert ratios and all(0 < r["predicted_volume_ratio"] < 1 for r in ratios)
    exact = sorted(abs(r["rel_error"]) for r in v if not r["dedup"])
    assert len(exact) < len(v)
    assert s["median_abs_error_without_dedup"] == pytest.approx(float(np.median(exact)))
    assert s["median_abs_error"] == pytest.approx(
        sorted(abs(r["rel_error"]) for r in v)[len(v) // 2], rel=0.5
    )
    for png in ("scaling.png", "timeline.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"


def test_schedules_the_profile_cannot_price_are_refused_before_planning(tmp_path: Path) -> None:
    for args, says in ((["profile=null"], "counted after clustering"),
                       (["schedules=[plain+dedup]"], "only nested")):  # fmt: skip
        proc = subprocess.run([sys.executable, "-m", "benchmarks.scale", *args,
                               f"hydra.run.dir={tmp_path}"], cwd=REPO, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        assert proc.returncode != 0 and says in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and "planned" not in proc.stdout
