"""Checkpoints written whole or not at all, checked against their manifest when loaded, and
a checkpoint directory that belongs to one run (recsys/checkpoint.py, recsys/preflight.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import flip_bytes, save_small_checkpoint

from recsys import checkpoint as ck
from recsys.checkpoint import (
    CheckpointCorruptError,
    latest_checkpoint,
    newest_good_checkpoint,
    remove_partial,
    verified_checkpoint,
)
from recsys.config import TrainConfigError
from recsys.preflight import CheckpointDirLock


def test_a_checkpoint_appears_whole_with_a_manifest_of_every_file(tmp_path: Path) -> None:
    path = save_small_checkpoint(tmp_path, 3)
    assert path == tmp_path / "step_00000003"
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["run_id"] == "run-a"
    on_disk = {p.name for p in path.iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk and ".metadata" in on_disk
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial left
    assert verified_checkpoint(tmp_path) == path


def test_a_write_cut_short_never_replaces_the_complete_checkpoint(tmp_path, monkeypatch) -> None:
    """A resumed run killed while rewriting step_6: the old step_6 stays whole and is still
    the newest; what the cut write left is never named and goes at the next claim."""
    save_small_checkpoint(tmp_path, 3)
    good = save_small_checkpoint(tmp_path, 6, seed=1)
    before = {p.name: p.read_bytes() for p in good.iterdir()}

    def dies_midway(state, checkpoint_id):  # the shards half written, then the rank dies
        Path(checkpoint_id, "__0_0.distcp").write_bytes(b"truncated")
        Path(checkpoint_id, ".metadata").write_bytes(b"new metadata")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck.dcp, "save", dies_midway)
    with pytest.raises(OSError, match=f"writing checkpoint '{good}' failed: No space left"):
        save_small_checkpoint(tmp_path, 6, seed=2)
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before
    assert latest_checkpoint(tmp_path) == good == verified_checkpoint(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000006"]
    # killed outright mid-write (SIGKILL): the partial directory stays, never named
    partial = tmp_path / ".step_00000009.partial"
    partial.mkdir()
    (partial / ".metadata").write_bytes(b"cut")
    assert latest_checkpoint(tmp_path) == good == verified_checkpoint(tmp_path)
    remove_partial(tmp_path)  # at the next claim of the directory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000006"]


def test_a_replacement_set_aside_comes_back_if_the_new_one_never_arrived(tmp_path) -> None:
    good = save_small_checkpoint(tmp_path, 6)
    aside = tmp_path / ".step_00000006.replaced"
    good.rename(aside)  # killed between the two renames of `_replace`
    remove_partial(tmp_path)
    assert verified_checkpoint(tmp_path) == good


@pytest.mark.parametrize(
    "fault", ["flipped", "truncated", "missing", "no manifest", "bad json", "run.json cut"]
)
def test_a_corrupt_newest_checkpoint_is_refused_naming_the_newest_good_one(tmp_path, fault):
    good = save_small_checkpoint(tmp_path, 3)
    bad = save_small_checkpoint(tmp_path, 6, seed=1)
    shard = bad / "__0_0.distcp"
    if fault == "flipped":
        flip_bytes(shard)
        why = "does not match its SHA-256"
    elif fault == "truncated":
        shard.write_bytes(shard.read_bytes()[:-10])
        why = "bytes, its manifest says"
    elif fault == "missing":
        shard.unlink()
        why = "is missing"
    elif fault == "no manifest":
        (bad / "manifest.json").unlink()
        (bad / ".metadata").touch()  # a write cut before its manifest, or an older version
        why = "has no manifest.json"
    elif fault == "bad json":
        (bad / "manifest.json").write_text("{not json")
        why = "is not a checkpoint manifest"
    else:  # it was a JSONDecodeError traceback without the file's name
        run = bad / "run.json"
        run.write_bytes(run.read_bytes()[:20])
        why = f"'{run}' has 20 bytes, its manifest says"
    with pytest.raises(CheckpointCorruptError) as e:
        verified_checkpoint(tmp_path)
    message = str(e.value)
    assert f"checkpoint '{bad}' cannot be trusted" in message and why in message
    assert f"the newest good checkpoint is '{good}': load it with trainer.resume_from={good}" in (
        message
    )
    assert newest_good_checkpoint(tmp_path) == good
    assert verified_checkpoint(good) == good  # asked for by name, the good one loads
    with pytest.raises(CheckpointCorruptError, match="load it with checkpoint="):
        verified_checkpoint(bad, key="checkpoint")  # named directly: refused all the same


def test_a_checkpoint_directory_belongs_to_one_run(tmp_path: Path) -> None:
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    with CheckpointDirLock(ckpts, "run-a", tmp_path / "a"):
        with pytest.raises(TrainConfigError, match=r"'.*ckpts' is in use by another run \(pid "):
            CheckpointDirLock(ckpts, "run-a", tmp_path / "a2")  # at once, even the same run
        save_small_checkpoint(ckpts, 3, run_id="run-a")
    with pytest.raises(TrainConfigError) as e:  # after it: another run is refused
        CheckpointDirLock(ckpts, "run-b", tmp_path / "b")
    assert str(e.value) == (
        f"trainer.checkpoint_dir '{ckpts}' holds the checkpoints of another run (run directory "
        f"{tmp_path / 'a'}); give this run its own trainer.checkpoint_dir, or resume that run "
        f"with trainer.resume_from={ckpts}"
    )
    with CheckpointDirLock(ckpts, "run-a", tmp_path / "resumed"):  # resuming it: its own
        pass
    (ckpts / "owner.json").unlink()  # checkpoints without a claim: their manifests decide
    with pytest.raises(TrainConfigError, match="holds the checkpoints of another run"):
        CheckpointDirLock(ckpts, "run-b", tmp_path / "b")
