"""A run's resolved facts, worked out once in the parent and handed to every rank.

The config is composed and checked by the app (`recsys.app.train`); the cluster is resolved
and the planner's inputs (tables with their access statistics, coverage curves, device and
link costs from the calibration) are built once there, and our plan, if any, is made there.
Every field pickles: spawned, emulated and torchrun ranks receive the same object.
"""

from __future__ import annotations

from dataclasses import dataclass

from recsys.config import TrainConfig
from sharding.types import Plan, PlanInputs, RankDevice


@dataclass(frozen=True)
class RunContext:
    cfg: TrainConfig
    inputs: PlanInputs  # what the planners read; TorchRec's planner runs on them in the ranks
    plan: Plan | None = None  # ours (hybrid, greedy_size, round_robin); None: TorchRec plans
    run_id: str = ""  # this run's identity in its checkpoints (a resumed run keeps its own)

    @property
    def ranks(self) -> list[RankDevice]:
        return self.inputs.ranks
