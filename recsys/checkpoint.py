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
"""

from __future__ import annotations

import json
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


Split = tuple[dict[str, np.ndarray], dict[str, int]]  # hot ids, cold parts; by feature


class CheckpointNotFoundError(UserError, FileNotFoundError):
    """trainer.resume_from names no checkpoint."""


class CheckpointMismatchError(UserError, ValueError):
    """A checkpoint that this run's model or plan cannot resume; the message names why."""


def checkpoint_path(root: str | Path, step: int) -> Path:
    return Path(root) / f"{STEP_PREFIX}{step:08d}"


def latest_checkpoint(path: str | Path) -> Path:
    """`path` itself if it is a checkpoint, else its newest `step_*` child."""
    path = Path(path)
    if (path / ".metadata").exists():
        return path
    steps = sorted(p for p in path.glob(f"{STEP_PREFIX}*") if (p / ".metadata").exists())
    if not steps:
        raise CheckpointNotFoundError(
            f"no checkpoint at '{path}': expected a DCP checkpoint directory (with .metadata) "
            f"or a directory of {STEP_PREFIX}* checkpoints; check trainer.resume_from"
        )
    return steps[-1]


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


def save_checkpoint(
    root: str | Path,
    model: torch.nn.Module,
    optimizer: KeyedOptimizer,
    step: int,
    run: dict | None = None,
    split: Split | None = None,
) -> Path:
    """Collective: every rank writes its shards to `root/step_<step>`; rank 0 also writes
    `run` (`{"model": ..., "dataset": ..., "plan_layout": [...]}`) as run.json and `split`
    (the split tables' hot ids and cold parts) as split.npz."""
    path = checkpoint_path(root, step)
    dcp.save(_state(model, optimizer, step), checkpoint_id=str(path))
    if not dist.is_initialized() or dist.get_rank() == 0:
        if run is not None:
            (path / RUN_FILE).write_text(json.dumps(run, indent=1) + "\n")
        if split is not None:
            hot_ids, parts = split
            arrays = {f: np.asarray(ids, dtype=np.int64) for f, ids in hot_ids.items()}
            arrays |= {f"{f}.parts": np.asarray(k, dtype=np.int64) for f, k in parts.items()}
            np.savez(path / SPLIT_FILE, **arrays)
    return path


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
    return json.loads(f.read_text()) if f.exists() else None


def first_model_difference(saved: dict, model: dict) -> str | None:
    """'model.<key>: <saved> in the checkpoint, <now> here' for the first differing key
    (`name` is a label, not a shape)."""
    for key in sorted((set(saved) | set(model)) - {"name"}):
        if saved.get(key) != model.get(key):
            return f"model.{key}: {saved.get(key)} in the checkpoint, {model.get(key)} here"
    return None


def _kinds(layout: list[dict]) -> dict[str, tuple[str, str]]:
    return {f"{r['module']}.{r['table']}": (r["table"], "data_parallel"
            if r["sharding_type"] == "data_parallel" else "sharded") for r in layout}  # fmt: skip


def check_resumable(path: str | Path, layout: list[dict]) -> None:
    """CheckpointMismatchError unless every table keeps its module and its kind
    (data-parallel or sharded) between the checkpoint's plan and `layout` (module
    docstring). A checkpoint without run.json is left to DCP's own checks."""
    run = saved_run(path)
    if run is None or "plan_layout" not in run:
        return
    then, now = _kinds(run["plan_layout"]), _kinds(layout)
    ckpt = latest_checkpoint(path)
    fix = (f"resume under the plan it was saved with (the same planner, cluster and batch "
           f"size; its layout is in {ckpt / RUN_FILE}) or start afresh")  # fmt: skip
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
