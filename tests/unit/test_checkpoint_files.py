"""Checkpoints written whole or not at all, checked against their manifest when loaded, and
a checkpoint directory that belongs to one run (recsys/checkpoint.py, recsys/preflight.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torchrec.optim.keyed import KeyedOptimizerWrapper

from recsys import checkpoint as ck
from recsys.checkpoint import (
    CheckpointCorruptError,
    latest_checkpoint,
    newest_good_checkpoint,
    remove_partial,
    save_checkpoint,
    verified_checkpoint,
)
from recsys.config import TrainConfigError
from recsys.preflight import CheckpointDirLock

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model_and_optimizer(seed: int) -> tuple[torch.nn.Module, KeyedOptimizerWrapper]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 8)
    params = dict(model.named_parameters())
    return model, KeyedOptimizerWrapper(params, lambda p: torch.optim.Adagrad(p, lr=0.1))


def _save(root: Path, step: int, seed: int = 0, run_id: str = "run-a") -> Path:
    model, opt = _model_and_optimizer(seed)
    run = {"model": {"name": "tiny"}, "dataset": {}, "plan_layout": []}
    return save_checkpoint(root, model, opt, step, run=run, run_id=run_id)


def _flip(path: Path, at: int = 100, n: int = 64) -> None:
    data = bytearray(path.read_bytes())
    data[at : at + n] = bytes(b ^ 0xFF for b in data[at : at + n])
    path.write_bytes(bytes(data))


def test_a_checkpoint_appears_whole_with_a_manifest_of_every_file(tmp_path: Path) -> None:
    path = _save(tmp_path, 3)
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
    _save(tmp_path, 3)
    good = _save(tmp_path, 6, seed=1)
    before = {p.name: p.read_bytes() for p in good.iterdir()}

    def dies_midway(state, checkpoint_id):  # the shards half written, then the rank dies
        Path(checkpoint_id, "__0_0.distcp").write_bytes(b"truncated")
        Path(checkpoint_id, ".metadata").write_bytes(b"new metadata")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck.dcp, "save", dies_midway)
    with pytest.raises(OSError, match="No space left"):
        _save(tmp_path, 6, seed=2)
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before
    assert latest_checkpoint(tmp_path) == good == verified_checkpoint(tmp_path)
    assert (tmp_path / ".step_00000006.partial").exists()
    remove_partial(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000003", "step_00000006"]


def test_a_replacement_set_aside_comes_back_if_the_new_one_never_arrived(tmp_path) -> None:
    good = _save(tmp_path, 6)
    aside = tmp_path / ".step_00000006.replaced"
    good.rename(aside)  # killed between the two renames of `_replace`
    remove_partial(tmp_path)
    assert verified_checkpoint(tmp_path) == good


@pytest.mark.parametrize("fault", ["flipped", "truncated", "missing", "no manifest", "bad json"])
def test_a_corrupt_newest_checkpoint_is_refused_naming_the_newest_good_one(tmp_path, fault):
    good = _save(tmp_path, 3)
    bad = _save(tmp_path, 6, seed=1)
    shard = bad / "__0_0.distcp"
    if fault == "flipped":
        _flip(shard)
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
    else:
        (bad / "manifest.json").write_text("{not json")
        why = "is not a checkpoint manifest"
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
        _save(ckpts, 3, run_id="run-a")
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
