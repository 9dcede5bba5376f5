"""docs/workflow.md runs as written: a user's own table converted by a schema, a cluster
with a GPU the catalog lacks, a plan made offline and trained as it is, the checkpoint
evaluated on the test split, exported and used to score a file; each step's output checked."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO

pytestmark = pytest.mark.slow

DOC = REPO / "docs" / "workflow.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), re.S)


def test_the_workflow_runs_as_written_and_each_step_holds(tmp_path: Path) -> None:
    (cluster,) = _blocks("yaml")
    where = cluster.splitlines()[0].removeprefix("# ").replace("/tmp/wf", str(tmp_path))
    Path(where).parent.mkdir(parents=True)
    Path(where).write_text(cluster)
    (commands,) = _blocks("bash")
    lines = [c for c in commands.splitlines() if c.startswith("python -m ")]
    assert [c.split()[2] for c in lines] == [
        "recsys.data.movielens",
        "recsys.data.tabular",
        "sharding.plan",
        "recsys.train",
        "recsys.evaluate",
        "recsys.export",
        "recsys.score",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = {}
    for i, line in enumerate(lines):
        line = line.replace("/tmp/wf", str(tmp_path)).replace("python ", f"{sys.executable} ", 1)
        if "hydra.run.dir=" not in line:
            line += f" hydra.run.dir={tmp_path / 'runs' / str(i)}"
        proc = subprocess.run(
            ["bash", "-c", line], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, f"{line}:\n{proc.stderr[-3000:]}"
        out[line.split()[2]] = proc.stdout

    # 2. the schema's conversion: the shapes the model needs, the same as the preset's
    override = (tmp_path / "data" / "model_override.txt").read_text().split()
    assert override == [
        "model.dense_in_features=2",
        "model.num_embeddings_per_feature=[944,1683,3,22,796,20]",
    ]
    # 4. the saved plan is the plan that trained, shard for shard
    saved = json.loads((tmp_path / "plan" / "plan.json").read_text())
    ran = json.loads((tmp_path / "train" / "plan.json").read_text())
    assert ran["tables"] == saved["tables"] and ran["cluster"] == "a10g_pair"
    assert {d["kind"] for d in ran["devices"]} == {"a10g_24g"}
    # 5. the test split, whole
    test = json.loads((tmp_path / "test" / "summary.json").read_text())
    assert test["mode"] == "evaluate" and test["eval_split"] == "test"
    assert f"test AUC {test['eval_auc']:.4f}" in out["recsys.evaluate"]
    assert 0.65 < test["eval_auc"] < 0.9 and 0 < test["eval_ne"] < 1
    # 6. the exported model scores the test samples as the sharded model did
    scores = np.loadtxt(tmp_path / "scores.csv", delimiter=",", skiprows=1)
    assert scores.shape == (100_000, 2)
    assert "100,000 samples scored" in out["recsys.score"]
    from torchmetrics.functional.classification import binary_auroc

    from recsys.data.criteo_binary import CriteoBinary

    sizes = [944, 1683, 3, 22, 796, 20]
    source = CriteoBinary(
        tmp_path / "data",
        sizes,
        [f"cat_{i}" for i in range(6)],
        256,
        2,
        holdout_fraction=0.142857,
        dense_features=2,
    )
    rows = np.concatenate(
        [
            source.rows_read("test", r, i)
            for r in range(2)
            for i in range(source.num_batches("test"))
        ]
    )
    assert len(rows) == test["eval_samples"]

    auc = float(
        binary_auroc(torch.from_numpy(scores[rows, 1]), torch.from_numpy(scores[rows, 0]).int())
    )
    assert auc == pytest.approx(test["eval_auc"], abs=1e-4)
