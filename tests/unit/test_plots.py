"""Every saved benchmark result with a summary.json draws its picture."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import REPO

from benchmarks.plots import redraw

RESULTS = REPO / "benchmarks" / "results"


PICTURES = {
    "pipeline": "pipelines.png",
    "plan_train": "plan_train.png",
    "planners": "planner_gains.png",
    "batch_split": "batch_split.png",
}


@pytest.mark.parametrize("name", sorted(p.parent.name for p in RESULTS.glob("*/summary.json")))
def test_saved_results_draw_their_picture(name: str, tmp_path: Path) -> None:
    shutil.copy(RESULTS / name / "summary.json", tmp_path / "summary.json")
    drawn = redraw(tmp_path)
    family = next((k for k in PICTURES if name.startswith(k)), None)
    if family is None:  # calibrate: a table, no picture
        assert drawn == []
        return
    assert drawn == [tmp_path / PICTURES[family]]
    assert drawn[0].read_bytes()[:4] == b"\x89PNG"
    assert (RESULTS / name / PICTURES[family]).exists()  # committed beside its numbers
