"""Checkpoint and resume with torch.distributed.checkpoint (DCP).

A checkpoint holds the sharded model (embedding shards and dense parameters), both
optimizers (fused embedding optimizer state and the dense one) and the data position:
`trainer.step`, the number of finished steps. Batches are a pure function of the step, so
resuming at step k continues with exactly the batches an uninterrupted run would see.
DCP reshards on load, so a checkpoint can be resumed under another world size or plan as
long as every table keeps its kind: sharded tables may move between ranks or be cut
otherwise, but a table that turns from data-parallel (trained by the dense optimizer) to
sharded (the fused row-wise optimizer), or the other way, or a split table (hybrid's hot
and cold parts) that is not split the same way, has optimizer state that cannot carry
over; `check_resumable` refuses those before anything is loaded, naming the table. Beside
DCP's files rank 0 writes `run.json`: the model and dataset configs and the plan layout it
was saved under (`sharding.plan_shards.plan_layout` rows), and for split tables `split.npz`:
each split feature's hot ids (which row of the hot table each id is) and its number of cold
row parts. A resumed run takes the split from there rather than counting ids again (another
world size reads other first batches), and `recsys.export` merges the parts back with it.

A checkpoint is written whole or not at all: every rank writes into `.step_<k>.partial`,
then rank 0 writes `manifest.json` last (each file's size and SHA-256, the step and the
run's identity) and renames the directory into place, replacing an older `step_<k>` only
once the new one is complete. A `step_*` directory is a checkpoint only with its manifest;
`verified_checkpoint` (what resume, evaluate and export call before loading) checks every
file against it, and when the newest checkpoint of a directory is corrupt says so and names
the newest good one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torchrec.optim.keyed import KeyedOptimizer

from sharding.errors import UserError

STEP_PREFIX = "step_"
RUN_FILE = "run.json"
SPLIT_FILE = "split.npz"  # per split feature: "<feature>" hot ids, "<feature>.parts" cold parts
MANIFEST_FILE = (
    "manifest.json"  # written last: {"step", "run_id", "files": {name: {bytes, sha256}}}
)
PARTIAL_SUFFIX = ".partial"  # `.step_<k>.partial`: a checkpoint being written
REPLACED_SUFFIX = ".replaced"  # `.step_<k>.replaced`: the one it replaces, until it is in place


Split = tuple[dict[str, np.ndarray], dict[str, int]]  # hot ids, cold parts; by feature


class CheckpointNotFoundError(UserError, FileNotFoundError):
    """trainer.resume_from names no checkpoint."""


class CheckpointMismatchError(UserError, ValueError):
    """A checkpoint that this run's model or plan cannot resume; the message names why."""


class CheckpointWriteError(UserError, OSError):
    """A checkpoint could not be written (a full disk, above all); nothing of it is kept."""


class CheckpointCorruptError(UserError, ValueError):
    """A checkpoint whose files do not match its manifest, or that has none."""


def checkpoint_path(root: str | Path, step: int) -> Path:
    return Path(root) / f"{STEP_PREFIX}{step:08d}"


def _is_checkpoint(path: Path) -> bool:
    """A checkpoint directory, complete or not (a manifest, or DCP's .metadata)."""
    return (path / MANIFEST_FILE).exists() or (path / ".metadata").exists()


def _candidates(root: Path) -> list[Path]:
    """`root`'s `step_*` checkpoint directories, newest first."""
    return sorted((p for p in root.glob(f"{STEP_PREFIX}*") if _is_checkpoint(p)), reverse=True)


def latest_checkpoint(path: str | Path) -> Path:
    """`path` itself if it is a checkpoint, else its newest `step_*` child with a manifest
    (files unread: `verified_checkpoint` checks them)."""
    path = Path(path)
    if _is_checkpoint(path):
        return path
    steps = [p for p in _candidates(path) if (p / MANIFEST_FILE).exists()]
    if not steps:
        raise CheckpointNotFoundError(
            f"no checkpoint at '{path}': expected a checkpoint directory (with {MANIFEST_FILE}) "
            f"or a directory of {STEP_PREFIX}* checkpoints; check trainer.resume_from"
        )
    return steps[0]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(path: str | Path, step: int, run_id: str) -> None:
    """`path/manifest.json`: every other file of the checkpoint with its size and SHA-256,
    the step and the run's identity; written (and synced) after everything it lists."""
    path = Path(path)
    files = {}
    for f in sorted(p for p in path.iterdir() if p.is_file() and p.name != MANIFEST_FILE):
        files[f.name] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
    manifest = {"format": 1, "step": step, "run_id": run_id, "files": files}
    tmp = path / f".{MANIFEST_FILE}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    _fsync(tmp)
    tmp.rename(path / MANIFEST_FILE)
    _fsync(path)


def read_manifest(path: str | Path) -> dict:
    """A checkpoint's manifest; CheckpointCorruptError if it is missing or unreadable."""
    f = Path(path) / MANIFEST_FILE
    if not f.exists():
        raise CheckpointCorruptError(
            f"checkpoint '{path}' has no {MANIFEST_FILE}: it was cut short while being written, "
            f"or an older version wrote it"
        )
    try:
        manifest = json.loads(f.read_text())
        manifest["files"].items()
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointCorruptError(f"'{f}' is not a checkpoint manifest (corrupt)") from None
    return manifest


def _first_fault(path: Path) -> str | None:
    """What is wrong with the checkpoint at `path` (a file missing, cut or changed), or None."""
    try:
        manifest = read_manifest(path)
    except CheckpointCorruptError as e:
        return str(e)
    for name, want in manifest["files"].items():
        f = path / name
        if not f.is_file():
            return f"'{f}' is missing"
        size = f.stat().st_size
        if size != want["bytes"]:
            return f"'{f}' has {size:,} bytes, its manifest says {want['bytes']:,}"
        if _sha256(f) != want["sha256"]:
            return f"'{f}' does not match its SHA-256 in {MANIFEST_FILE} (corrupted on disk)"
    return None


def newest_good_checkpoint(root: str | Path) -> Path | None:
    """The newest `step_*` checkpoint of `root` whose files match its manifest, or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    return next((p for p in _candidates(root) if _first_fault(p) is None), None)


def verified_checkpoint(path: str | Path, key: str = "trainer.resume_from") -> Path:
    """The checkpoint `path` names (itself, or the newest `step_*` in it), its files checked
    against its manifest; CheckpointCorruptError naming the fault and the newest good
    checkpoint (`key` is what the user sets to load it), which is never taken silently."""
    path = Path(path)
    ckpt = path if _is_checkpoint(path) else None
    root = path.parent if ckpt is not None else path
    if ckpt is None:
        found = _candidates(path)
        if not found:
            raise CheckpointNotFoundError(
                f"no checkpoint at '{path}': expected a checkpoint directory (with "
                f"{MANIFEST_FILE}) or a directory of {STEP_PREFIX}* checkpoints; check {key}"
            )
        ckpt = found[0]
    fault = _first_fault(ckpt)
    if fault is None:
        return ckpt
    good = newest_good_checkpoint(root)
    fix = (
        f"the newest good checkpoint is '{good}': load it with {key}={good}"
        if good
        else f"no good checkpoint is left in '{root}'"
    )
    raise CheckpointCorruptError(f"checkpoint '{ckpt}' cannot be trusted: {fault}; {fix}")


def checkpoint_run_id(path: str | Path) -> str | None:
    """The identity of the run that wrote the checkpoint at `path` (its manifest's)."""
    try:
        return read_manifest(latest_checkpoint(path)).get("run_id")
    except (CheckpointCorruptError, CheckpointNotFoundError):
        return None


def remove_partial(root: str | Path) -> None:
    """Checkpoints cut short while being written (a rank or the disk failed) go; one set
    aside for its replacement (`_replace`) that never came goes back under its name."""
    root = Path(root)
    for partial in sorted(root.glob(f".{STEP_PREFIX}*")) if root.is_dir() else ():
        if partial.name.endswith(PARTIAL_SUFFIX):
            shutil.rmtree(partial, ignore_errors=True)
        elif partial.name.endswith(REPLACED_SUFFIX):
            final = root / partial.name[1 : -len(REPLACED_SUFFIX)]
            if final.exists():
                shutil.rmtree(partial, ignore_errors=True)
            else:
                partial.rename(final)


def checkpoint_step(path: str | Path) -> int | None:
    """The step a checkpoint (or the newest in a directory of them) holds, from its name;
    None if its name does not say."""
    name = latest_checkpoint(path).name
    tail = name[len(STEP_PREFIX) :]
    return int(tail) if name.startswith(STEP_PREFIX) and tail.isdigit() else None


def _state(model: torch.nn.Module, optimizer: KeyedOptimizer, step: int) -> dict:
    return {
        "model": model.state_dict(),
        "optim": optimizer.state_dict(),
        "trainer": {"step": torch.tensor(step, dtype=torch.int64)},
    }


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()  # within the process group's timeout (trainer.dist_timeout_s)


def save_checkpoint(
    root: str | Path,
    model: torch.nn.Module,
    optimizer: KeyedOptimizer,
    step: int,
    run: dict | None = None,
    split: Split | None = None,
    run_id: str = "",
) -> Path:
    """Collective: every rank writes its shards into `root/.step_<step>.partial`; rank 0 also
    writes `run` (`{"model": ..., "dataset": ..., "plan_layout": [...]}`) as run.json,
    `split` (the split tables' hot ids and cold parts) as split.npz and, last, the manifest
    naming `run_id`, then renames the directory to `root/step_<step>` (module docstring).
    Returns that path (in place on rank 0 when it returns there)."""
    final = checkpoint_path(root, step)
    tmp = final.with_name(f".{final.name}{PARTIAL_SUFFIX}")
    first = not dist.is_initialized() or dist.get_rank() == 0
    if first:  # what a killed writer left under this name goes first
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    try:
        dcp.save(_state(model, optimizer, step), checkpoint_id=str(tmp))  # .metadata: every rank's
        if first:
            if run is not None:
                (tmp / RUN_FILE).write_text(json.dumps(run, indent=1) + "\n")
            if split is not None:
                hot_ids, parts = split
                arrays = {f: np.asarray(ids, dtype=np.int64) for f, ids in hot_ids.items()}
                arrays |= {f"{f}.parts": np.asarray(k, dtype=np.int64) for f, k in parts.items()}
                np.savez(tmp / SPLIT_FILE, **arrays)
            write_manifest(tmp, step, run_id)
            _replace(tmp, final)
    except (Exception, CheckpointException) as e:  # the latter derives from BaseException
        text = str(e)
        full = any(s in text for s in ("No space left on device", "[Errno 28]"))
        why = "No space left on device [Errno 28]" if full else (text.strip() or repr(e))
        shutil.rmtree(tmp, ignore_errors=True)  # nothing of it is kept: a full disk is freed
        raise CheckpointWriteError(f"writing checkpoint '{final}' failed: {why[:300]}") from e
    return final  # the other ranks go on: the next collective waits for rank 0 anyway


def _replace(new: Path, final: Path) -> None:
    """`new` renamed to `final`; an older `final` is set aside first and removed only after,
    so a crash between leaves no half of either under the name."""
    old = final.with_name(f".{final.name}{REPLACED_SUFFIX}")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    new.rename(final)
    _fsync(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def saved_split(path: str | Path) -> Split | None:
    """The split.npz of a checkpoint (or the newest in a directory): per split feature its
    sorted hot ids and its cold parts; None if the checkpoint has no split tables."""
    f = latest_checkpoint(path) / SPLIT_FILE
    if not f.exists():
        return None
    with np.load(f) as z:
        hot = {k: z[k] for k in z.files if not k.endswith(".parts")}
        parts = {k[: -len(".parts")]: int(z[k]) for k in z.files if k.endswith(".parts")}
    return hot, parts


def saved_run(path: str | Path) -> dict | None:
    """The run.json of a checkpoint (or the newest in a directory); None if it has none."""
    f = latest_checkpoint(path) / RUN_FILE
    if not f.exists():
        return None
    try:
        return json.loads(f.read_text())
    except ValueError as e:
        raise CheckpointCorruptError(
            f"'{f}' is not valid JSON ({e}): the checkpoint is corrupt"
        ) from None


def no_model_message(path: str | Path) -> str:
    """Why a checkpoint without run.json is refused (by resume, evaluate and export alike)."""
    return (
        f"checkpoint '{path}' has no {RUN_FILE} naming its model: resume, evaluate and "
        f"export read checkpoints that recsys.train saved (it writes one with each)"
    )


def first_model_difference(saved: dict, model: dict) -> str | None:
    """'model.<key>: <saved> in the checkpoint, <now> here' for the first differing key
    (`name` is a label, not a shape)."""
    for key in sorted((set(saved) | set(model)) - {"name"}):
        if saved.get(key) != model.get(key):
            return f"model.{key}: {saved.get(key)} in the checkpoint, {model.get(key)} here"
    return None


def _kinds(layout: list[dict]) -> dict[str, tuple[str, str]]:
    return {
        f"{r['module']}.{r['table']}": (
            r["table"],
            "data_parallel" if r["sharding_type"] == "data_parallel" else "sharded",
        )
        for r in layout
    }


def check_resumable(path: str | Path, layout: list[dict]) -> None:
    """CheckpointMismatchError unless every table keeps its module and its kind
    (data-parallel or sharded) between the checkpoint's plan and `layout` (module
    docstring). A checkpoint without run.json is left to DCP's own checks."""
    run = saved_run(path)
    if run is None or "plan_layout" not in run:
        return
    then, now = _kinds(run["plan_layout"]), _kinds(layout)
    ckpt = latest_checkpoint(path)
    fix = (
        f"resume under the plan it was saved with (the same planner, cluster and batch "
        f"size; its layout is in {ckpt / RUN_FILE}) or start afresh"
    )
    for key in sorted(set(then) | set(now)):
        if key not in now or key not in then:
            where = "only in the checkpoint's plan" if key in then else "only in this plan"
            raise CheckpointMismatchError(
                f"checkpoint '{ckpt}' was saved under another plan: embedding '{key}' is "
                f"{where} (split tables differ); {fix}"
            )
        if then[key] != now[key]:
            raise CheckpointMismatchError(
                f"checkpoint '{ckpt}' was saved under another plan: table {then[key][0]} was "
                f"{then[key][1]} there and is {now[key][1]} here, so its optimizer state "
                f"cannot carry over; {fix}"
            )


def load_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: KeyedOptimizer,
    dense_optimizer: KeyedOptimizer,
    layout: list[dict] | None = None,
) -> int:
    """Collective: load in place and return the step to resume from (`layout`: this run's
    plan, checked against the checkpoint's first; see check_resumable)."""
    path = latest_checkpoint(path)
    if layout is not None:
        check_resumable(path, layout)
    dense_optimizer.init_state()  # lazy optimizer state must exist to be loaded in place
    state = _state(model, optimizer, 0)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as e:  # the latter derives from BaseException
        rank = dist.get_rank() if dist.is_initialized() else 0
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise RuntimeError(
            f"rank {rank}: checkpoint '{path}' cannot be loaded (corrupt, or the model or "
            f"optimizer differ): {first[:300]}"
        ) from e
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    return int(state["trainer"]["step"])
