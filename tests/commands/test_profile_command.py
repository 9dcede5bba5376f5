"""`python -m sharding.profile`: writes the profile's json and picture."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import CONF_DIR

from sharding.access_profile import AccessProfile


def test_profile_command_writes_json_and_png(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sharding.profile",
            "batches=10",
            "batch_size=512",
            f"output={tmp_path}",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        cwd=CONF_DIR.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    raw = json.loads((tmp_path / "profile.json").read_text())
    assert len(raw["tables"]) == 26
    for t in raw["tables"]:
        assert {"name", "rows", "lookups_per_sample", "coverage"} <= set(t)
        assert set(t["coverage"]) == {"0.1%", "1%", "10%"}
    assert (tmp_path / "profile.png").read_bytes()[:4] == b"\x89PNG"
    loaded = AccessProfile.load(tmp_path / "profile.json")
    assert loaded.samples == 5120 and loaded.table("t_cat_2").rows == 20_000
    assert "top 1%" in proc.stdout
    # distinct ids per micro-batch of 64 ... 512 samples, counted in both orders
    t = loaded.table("t_cat_2")
    assert set(t.distinct_per_samples) == {"64", "128", "256", "512"}
    assert set(t.distinct_per_samples_clustered) == set(t.distinct_per_samples)
    counts = [t.distinct_per_samples[k] for k in ("64", "128", "256", "512")]
    assert counts == sorted(counts) and counts[0] <= 64 and counts[-1] <= 512
