"""Functions the launcher runs in spawned ranks (spawn imports them by module name)."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from recsys import launch


def all_reduce_rank(timeout_s: float) -> dict:
    rank, world = launch.init_distributed(timeout_s)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {"rank": rank, "world": world, "sum": float(t)}


def one_rank_raises(timeout_s: float) -> dict:
    rank, _ = launch.init_distributed(timeout_s)
    if rank == 1:
        raise ValueError("rank 1 broke on purpose")
    dist.all_reduce(torch.ones(1))  # rank 0 waits for a peer that is gone
    return {"rank": rank}


def one_rank_hangs(timeout_s: float) -> dict:
    rank, _ = launch.init_distributed(timeout_s)
    if rank == 1:
        time.sleep(3600)
    dist.all_reduce(torch.ones(1))  # times out after timeout_s
    return {"rank": rank}


def _fault_at(step: int, rank: int, action) -> None:
    """Make `rank` run `action` when it fetches the batch of `step`."""
    from recsys.data import synthetic

    original = synthetic.SyntheticCriteo.batch

    def batch(self, split, index, r):
        if split == "train" and index == step and r == rank:
            action()
        return original(self, split, index, r)

    synthetic.SyntheticCriteo.batch = batch


def train_rank_dies(cfg, run_dir: str) -> dict:
    from recsys.train import _rank_main

    _fault_at(3, 1, lambda: os._exit(17))
    return _rank_main(cfg, run_dir)


def train_rank_hangs(cfg, run_dir: str) -> dict:
    from recsys.train import _rank_main

    _fault_at(3, 1, lambda: time.sleep(3600))
    return _rank_main(cfg, run_dir)
