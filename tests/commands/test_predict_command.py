"""`python -m sharding.predict`: prices a plan and prints the step."""

from __future__ import annotations

import json

import pytest
from conftest import REPO


def test_predict_command_plans_and_prints_the_step(tmp_path) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sharding.predict",
            "cluster=hetero_3node",
            "model=dcnv2_mlperf",
            "trainer.batch_size=8192",
            "pipeline=sparse_dist",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((tmp_path / "predict.json").read_text())
    assert result["pipeline"] == "sparse_dist" and len(result["memory_bytes"]) == 24
    assert result["step_ms"] == pytest.approx(
        sum(result["stages_ms"].values()) - result["stages_ms"]["ids_a2a"], rel=0.01
    )  # ids hidden under dense compute
    assert "ms/step predicted" in proc.stdout
