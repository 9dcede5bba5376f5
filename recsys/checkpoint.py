"""Checkpoint and resume with torch.distributed.checkpoint (DCP).

A checkpoint holds the sharded model (embedding shards and dense parameters), both
optimizers (fused embedding optimizer state and the dense one) and the data position:
`trainer.step`, the number of finished steps. Batches are a pure function of the step, so
resuming at step k continues with exactly the batches an uninterrupted run would see.
DCP reshards on load, so a checkpoint can be resumed under another plan or world size.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torchrec.optim.keyed import KeyedOptimizer

STEP_PREFIX = "step_"


def checkpoint_path(root: str | Path, step: int) -> Path:
    return Path(root) / f"{STEP_PREFIX}{step:08d}"


def latest_checkpoint(path: str | Path) -> Path:
    """`path` itself if it is a checkpoint, else its newest `step_*` child."""
    path = Path(path)
    if (path / ".metadata").exists():
        return path
    steps = sorted(p for p in path.glob(f"{STEP_PREFIX}*") if (p / ".metadata").exists())
    if not steps:
        raise FileNotFoundError(
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
    root: str | Path, model: torch.nn.Module, optimizer: KeyedOptimizer, step: int
) -> Path:
    """Collective: every rank writes its shards to `root/step_<step>`."""
    path = checkpoint_path(root, step)
    dcp.save(_state(model, optimizer, step), checkpoint_id=str(path))
    return path


def load_checkpoint(
    path: str | Path,
    model: torch.nn.Module,
    optimizer: KeyedOptimizer,
    dense_optimizer: KeyedOptimizer,
) -> int:
    """Collective: load in place and return the step to resume from."""
    path = latest_checkpoint(path)
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
