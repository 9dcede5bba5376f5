"""Two ranks train on generated Criteo files, prepared by the converter."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import compose_config, run_command

from recsys.app.train import train


@pytest.mark.slow
def test_two_rank_training_on_generated_files(kaggle_files, tmp_path: Path) -> None:
    _, binary = kaggle_files
    cfg = compose_config(
        [
            "dataset=synthetic_criteo",
            f"dataset.path={binary}",
            "debug=tiny",
            "trainer.batch_size=128",
            "trainer.max_steps=30",
        ]
    )
    summary = train(cfg, tmp_path)
    assert summary["world_size"] == 2 and summary["steps"] == 30
    # debug=tiny asks for 2 eval batches per rank; the val split (429 rows) holds 1 per rank
    assert summary["eval_samples"] == 2 * 1 * 128
    assert 0.0 < summary["eval_auc"] < 1.0 and np.isfinite(summary["train_loss"])


@pytest.mark.slow
def test_a_checkpoint_evaluates_on_the_whole_val_or_test_split(kaggle_files, tmp_path) -> None:
    """`python -m recsys.evaluate` loads the checkpoint a run saved and reports the run's own
    final evaluation (the whole val split: `dataset.eval_batches=null`), then the test
    split's, which the run never read; NE beside AUC and log loss."""
    _, binary = kaggle_files
    common = [
        "dataset=synthetic_criteo",
        f"dataset.path={binary}",
        "debug=tiny",
        "trainer.batch_size=32",
        "dataset.eval_batches=null",
    ]
    run = train(
        compose_config(common + ["trainer.max_steps=6", "trainer.save_checkpoint=true"]),
        tmp_path / "run",
    )
    # the val split: 429 rows, 6 whole global batches of 2 x 32
    assert run["eval_split"] == "val" and run["eval_samples"] == 6 * 64
    assert 0 < run["eval_ne"] < 2 and np.isfinite(run["eval_logloss"])
    ckpt = f"trainer.resume_from={run['checkpoint']}"
    val = run_command("recsys.evaluate", *common, ckpt, f"hydra.run.dir={tmp_path / 'val'}")
    assert val.returncode == 0, val.stderr[-2000:]
    line = f"val AUC {run['eval_auc']:.4f} | log loss {run['eval_logloss']:.4f} | NE "
    assert line in val.stdout and "384 samples | checkpoint step 6" in val.stdout
    summary = json.loads((tmp_path / "val" / "summary.json").read_text())
    assert summary["mode"] == "evaluate" and summary["eval_auc"] == run["eval_auc"]
    assert summary["eval_ne"] == pytest.approx(run["eval_ne"], rel=1e-12)
    test = run_command(
        "recsys.evaluate",
        *common,
        ckpt,
        "dataset.eval_split=test",
        f"hydra.run.dir={tmp_path / 'test'}",
    )
    assert test.returncode == 0, test.stderr[-2000:]
    held = json.loads((tmp_path / "test" / "summary.json").read_text())
    assert held["eval_split"] == "test" and held["eval_samples"] == 6 * 64  # 428 rows
    assert held["eval_auc"] != run["eval_auc"]
    # a checkpoint at max_steps: training refuses it and says how to evaluate it instead
    again = run_command(
        "recsys.train", *common, ckpt, "trainer.max_steps=6", f"hydra.run.dir={tmp_path / 'again'}"
    )
    assert again.returncode == 1
    assert "python -m recsys.evaluate trainer.resume_from=" in again.stderr


@pytest.mark.slow
def test_an_exported_model_scores_prepared_files_and_text(tmp_path: Path) -> None:
    """Train on files `prepare` wrote, export the checkpoint, score the prepared directory
    and the text it came from: the same scores as the exported model gives those rows, the
    same from text as from the prepared rows, labels kept (-1 for the unlabeled test file)."""
    from recsys.data.prepare import PrepareConfig, prepare
    from recsys.data.synthetic_files import SynthConfig, synthesize
    from recsys.export import load_exported, model_config_of, prepared_batches, score_batches

    synthesize(SynthConfig(output=str(tmp_path / "tsv"), rows=2000, test_rows=100, scale=1000))
    prepare(
        PrepareConfig(input=str(tmp_path / "tsv"), output=str(tmp_path / "bin"), progress=False)
    )
    run = train(
        compose_config(
            [
                "dataset=synthetic_criteo",
                f"dataset.path={tmp_path / 'bin'}",
                "debug=tiny",
                "trainer.batch_size=32",
                "trainer.save_checkpoint=true",
            ]
        ),
        tmp_path / "run",
    )
    exported = tmp_path / "export"
    out = run_command(
        "recsys.export",
        f"checkpoint={run['checkpoint']}",
        f"output={exported}",
        f"hydra.run.dir={tmp_path / 'e'}",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"score a file with: python -m recsys.score export={exported}" in out.stdout

    scored = tmp_path / "scores.csv"
    out = run_command(
        "recsys.score",
        f"export={exported}",
        f"input={tmp_path / 'bin'}",
        f"output={scored}",
        f"hydra.run.dir={tmp_path / 's'}",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "2,100 samples scored" in out.stdout and "AUC 0." in out.stdout
    table = np.loadtxt(scored, delimiter=",", skiprows=1)
    assert table.shape == (2100, 2) and set(table[:, 0]) == {-1, 0, 1}
    model, meta = load_exported(exported)
    assert meta["step"] == 6 and meta["prepared"]["dense"]["transform"] == "torchrec"
    batches = prepared_batches(tmp_path / "bin", model_config_of(meta["model"]), None, 512)
    scores, labels = score_batches(model, batches)
    np.testing.assert_allclose(table[:, 1], scores, rtol=1e-6)
    np.testing.assert_array_equal(table[:, 0], labels)

    (text,) = [p for p in (tmp_path / "tsv").iterdir() if p.name.startswith("train")]
    npy = tmp_path / "text.npy"
    out = run_command(
        "recsys.score",
        f"export={exported}",
        f"input={text}",
        f"output={npy}",
        f"hydra.run.dir={tmp_path / 't'}",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    from_text = np.load(npy)
    train_rows = table[table[:, 0] >= 0]  # the prepared train file's rows, in order
    np.testing.assert_allclose(from_text, train_rows, rtol=1e-6)

    again = run_command(
        "recsys.score",
        f"export={exported}",
        f"input={text}",
        f"output={npy}",
        f"hydra.run.dir={tmp_path / 't2'}",
    )
    assert again.returncode == 1
    assert "exists; choose a new file or pass overwrite=true" in again.stderr
    wrong = run_command(
        "recsys.score",
        f"export={tmp_path / 'bin'}",
        f"input={text}",
        f"output={tmp_path / 'x.csv'}",
        f"hydra.run.dir={tmp_path / 't3'}",
    )
    assert wrong.returncode == 1 and "is not an exported model" in wrong.stderr
