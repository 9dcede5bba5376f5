"""`python -m sharding.predict [trainer overrides] [link=loopback]`: the cost model's
prediction for a training config, without training.

Plans the model with the configured planner on the meta device (or reads the
`plan_layout.json` of a finished run, `layout=<file>`), then prints per-rank memory and
stage times and the predicted step time of the configured pipeline, and writes
`predict.json`. A command module: it reads the trainer's config (conf/config.yaml).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from hydra.core.config_store import ConfigStore

from recsys.app.entry import hydra_command
from recsys.config import TrainConfig, register_configs
from recsys.models.dlrm import build_model
from sharding.calibration import Calibration, calibrated_link, constants_source
from sharding.cost_model import schedule_of
from sharding.memory import rank_memory
from sharding.plan_eval import shards_cost
from sharding.plan_shards import LayoutError, check_layout, plan_layout, shards_from_layout
from sharding.types import StepCost


@dataclass
class PredictConfig(TrainConfig):
    link: str | None = None  # calibrated local link (loopback, veth_1gbit); GPUs: the spec
    layout: str | None = None  # a run's plan_layout.json; default: plan with cfg.planner


def predict(
    cfg: TrainConfig,
    layout: list[dict] | None = None,
    link: str | None = None,
    cal: Calibration | None = None,
    batch_per_rank: list[int] | None = None,
) -> dict:
    """Predicted memory and step time of `cfg` (its plan: `layout`, else TorchRec's plan
    of it; `batch_per_rank`: a speed-aware split, else the config's batch on every rank).
    CPU clusters use `cal`, by default the calibration file."""
    from recsys.app.planning import plan_inputs
    from sharding.torchrec_planner import plan_with_torchrec

    inputs = plan_inputs(cfg, None, link, cal)
    if layout is None:
        model = build_model(cfg.model, dense_device=torch.device("meta"))
        layout = plan_layout(plan_with_torchrec(model, inputs, cfg.planner).plan)
    check_layout(layout)
    shards = shards_from_layout(layout, inputs.tables, inputs.world, inputs.coverage)
    batch = batch_per_rank or [cfg.trainer.batch_size] * inputs.world
    cost: StepCost = shards_cost(shards, batch, inputs)  # as sharding.plan prices a plan
    schedule = schedule_of(cfg.pipeline.name.value)
    n = cfg.pipeline.micro_batches
    step_s = cost.step_s(schedule, n)
    return {
        "cluster": cfg.cluster.name,
        "model": cfg.model.name,
        "pipeline": schedule.value,
        "precision": inputs.precision,  # the dense part's, which step_ms prices
        "batch_size_per_rank": cfg.trainer.batch_size,
        "link": calibrated_link(cfg.cluster, link or cfg.planner.link) if inputs.cpu else "spec",
        "step_ms": 1000 * step_s,
        "stages_ms": {
            "lookup_fwd": 1000 * max(cost.lookup_fwd_s),
            "lookup_bwd": 1000 * max(cost.lookup_bwd_s),
            "ids_a2a": 1000 * max(cost.ids_a2a_s),
            "emb_a2a_fwd_bwd": 1000 * (max(cost.emb_a2a_fwd_s) + max(cost.emb_a2a_bwd_s)),
            "dense": 1000 * max(cost.dense_s),
            "allreduce": 1000 * cost.allreduce_s,
            "overhead_and_input": 1000 * cost.fixed_s(schedule, n),
            "split tables": 1000 * max(cost.split_s, default=0.0),
            "feeding_the_batch": 1000
            * (cost.step_s(schedule, n) - cost.device_step_s(schedule, n)),
        },
        # per rank: hbm and host in all, and hbm by part (sharding.memory)
        "memory_bytes": rank_memory(inputs, shards, batch),
        "constants": {k: constants_source(k) for k in sorted({r.kind for r in inputs.ranks})},
        "a2a_bytes_per_rank": cost.a2a_bytes,
        "layout": layout,
    }


register_configs()
ConfigStore.instance().store(name="base_predict", node=PredictConfig)


@hydra_command("predict")
def main(typed: PredictConfig, run_dir: Path) -> None:
    layout = None
    if typed.layout:
        try:
            layout = json.loads(Path(typed.layout).read_text())
            check_layout(layout)
        except (OSError, json.JSONDecodeError, LayoutError) as e:
            raise LayoutError(
                f"layout={typed.layout} is not a plan_layout.json written by a training run: {e}"
            ) from e
    result = predict(typed, layout, typed.link)
    out = run_dir / "predict.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"{result['model']} on {result['cluster']}, {result['pipeline']}, batch "
        f"{result['batch_size_per_rank']}/rank, link {result['link']}: "
        f"{result['step_ms']:.1f} ms/step predicted"
    )
    for stage, ms in result["stages_ms"].items():
        print(f"  {stage:20} {ms:9.2f} ms (slowest rank)")
    for r, mem in enumerate(result["memory_bytes"]):
        print(f"  rank {r}: HBM {mem['hbm'] / 2**30:.3f} GiB, host {mem['host'] / 2**30:.3f} GiB")
    for kind, source in result["constants"].items():
        print(f"  {kind} constants: {source}")
    print(f"written: {out}")


if __name__ == "__main__":
    main()
