"""`python -m recsys.train`: train a DLRM from Hydra configs on N ranks.

Started plainly, it spawns the cluster config's world size of local gloo processes itself.
Started by torchrun (RANK/WORLD_SIZE set) or as a multi-task Slurm step (Hydra's submitit
launcher), every process is one rank. `train(cfg)` is the testable core.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import uuid
import warnings
from dataclasses import asdict, replace
from pathlib import Path

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig
from tqdm import tqdm

from pipelines.types import PipelineName
from recsys import launch, preflight
from recsys.app import CONF_DIR
from recsys.app.planning import (
    SavedPlanError,
    load_plan,
    make_plan,
    on_part,
    plan_inputs,
    plan_json,
    saved_part,
)
from recsys.checkpoint import (
    checkpoint_run_id,
    checkpoint_step,
    first_model_difference,
    no_model_message,
    saved_run,
    verified_checkpoint,
)
from recsys.config import (
    DenseAllreduce,
    Mode,
    TrainConfig,
    TrainConfigError,
    check_train_config,
    register_configs,
    to_object,
    validate_model_config,
)
from recsys.console import command, rank_output_to_log
from recsys.context import RunContext
from recsys.data.multi_hot import resolve_hotness
from recsys.models.dlrm import build_model
from sharding.cluster import compute_device_type
from sharding.constants import DEVICE_CATALOG, gpu_kind
from sharding.cost_model import hierarchical_pays, ranks_per_node, schedule_of
from sharding.errors import UserError
from sharding.plan_eval import check_fits
from sharding.torchrec_planner import plan_with_torchrec
from sharding.two_d import group_inputs, rank_shares
from sharding.types import FLOAT_BYTES, Plan, PlanDoesNotFitError, PlanInputs, PlannerName

log = logging.getLogger(__name__)


def quiet_library_noise(log_level: str = "info") -> None:
    """Filter warnings TorchRec and torch print on every run (each named below);
    `log_level="debug"` (trainer.log_level) keeps every library message."""
    if log_level == "debug":
        return
    for pattern in (
        ".*Topology constructed directly.*",
        ".*HeuristicalStorageReservation.*",
        ".*broadcast_buffers.*",
        ".*is_fx_tracing.*",
        ".*_check_unpickable_fn.*",
        ".*TypedStorage is deprecated.*",
        ".*autograd kernel was not registered.*",  # fbgemm CPU dense TBE; its grads are right
        ".*non-tuple sequence for multidimensional indexing.*",  # torchmetrics' gather
    ):
        warnings.filterwarnings("ignore", message=pattern)
    warnings.filterwarnings("ignore", category=FutureWarning)
    for name in ("torchrec", "torch.distributed", "torch.fx", "fbgemm_gpu", "iopath"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger().addFilter(_not_library_chatter)


def _not_library_chatter(record: logging.LogRecord) -> bool:
    """False for what FBGEMM and TorchRec log on the root logger below WARNING (FBGEMM's
    TBE prints its arguments for every table group: 32 lines per tiny run under torchrun,
    where Hydra's root handler shows them) and TorchRec's 'Sharding spec not found' for
    every data-parallel table."""
    library = any(
        f"{os.sep}{name}{os.sep}" in record.pathname for name in ("fbgemm_gpu", "torchrec")
    )
    if library and record.levelno < logging.WARNING:
        return False
    return not str(record.msg).startswith("Sharding spec not found")


def plan_ours(cfg: TrainConfig, inputs: PlanInputs, run_dir: Path) -> Plan:
    """Plan with our planner (hybrid, greedy_size, round_robin) before any rank starts, or
    read the saved plan `trainer.plan`; the ranks run this plan. Writes plan.json beside the
    run's other outputs."""
    if cfg.trainer.plan:
        keep = saved_part(cfg.trainer.plan, inputs)
        if keep is not None:  # a plan for part of this cluster: judged there
            cfg, inputs = on_part(cfg, inputs, keep)
        plan = load_plan(cfg.trainer.plan, inputs)
        if DenseAllreduce(cfg.trainer.dense_allreduce) == DenseAllreduce.auto:  # priced both ways
            by_node = load_plan(
                cfg.trainer.plan,
                replace(inputs, network=replace(inputs.network, hierarchical_allreduce=True)),
            )
            plan = min(plan, by_node, key=lambda p: p.est_step_ms)
        log.info(
            "training the saved %s plan %s as it is (predicted %.2f ms/step here)",
            plan.planner,
            cfg.trainer.plan,
            plan.est_step_ms,
        )
        asked, made = cfg.trainer.sharding_group_size, plan.sharding_group_size or inputs.world
        if asked and asked != made:
            raise SavedPlanError(
                f"trainer.plan: '{cfg.trainer.plan}' is a plan for groups of {made} ranks, not "
                f"{asked}: leave trainer.sharding_group_size unset (the plan's is used)"
            )
    else:
        plan = make_plan(cfg, inputs)
    (run_dir / "plan.json").write_text(json.dumps(plan_json(plan), indent=1) + "\n")
    if cfg.pipeline.name != PipelineName.plain and not cfg.trainer.dry_run and not cfg.trainer.plan:
        _say_if_plan_follows_pipeline(cfg, inputs, plan)
    if not plan.feasible:
        raise PlanDoesNotFitError(f"the {plan.planner} plan does not fit: see {run_dir}/plan.json")
    replicated = [t.name for t in plan.tables if t.replicated_rows]
    if cfg.pipeline.name == PipelineName.semi_sync and replicated:
        raise TrainConfigError(
            f"pipeline=semi_sync cannot train the {plan.planner} plan: it replicates rows of "
            f"{', '.join(replicated[:5])}{' ...' if len(replicated) > 5 else ''} (data-parallel), "
            f"and TorchRec's SemiSync cannot train data-parallel tables. Use planner=torchrec "
            f"(it then plans without them) or another pipeline (sparse_dist, nested)"
        )
    return plan


def _resolve_auto_reduction(cfg: TrainConfig, inputs: PlanInputs, plan: Plan | None) -> TrainConfig:
    """`trainer.dense_allreduce=auto`, decided before any rank starts: our plan's reduction
    (the planner priced both), or with TorchRec's planner the faster for the dense
    parameters alone (`cost_model.hierarchical_pays`)."""
    if plan is not None:
        hierarchical = plan.dense_allreduce == "hierarchical"
    else:
        per_node = ranks_per_node([r.node for r in inputs.ranks])
        dense_bytes = inputs.dense_params * FLOAT_BYTES
        hierarchical = hierarchical_pays(dense_bytes, per_node, inputs.network)
    mode = DenseAllreduce.hierarchical if hierarchical else DenseAllreduce.buckets
    log.info(
        "trainer.dense_allreduce=auto: %s (the cost model's faster dense reduction here)",
        mode.value,
    )
    return replace(cfg, trainer=replace(cfg.trainer, dense_allreduce=mode))


def _say_if_plan_follows_pipeline(cfg: TrainConfig, inputs: PlanInputs, plan: Plan) -> None:
    """Our planners price the pipeline's schedule, so another pipeline can get another plan;
    a pipeline equals the plain loop only under one plan. Say so when it happened here."""
    plain_cfg = replace(cfg, pipeline=replace(cfg.pipeline, name=PipelineName.plain))
    other = make_plan(plain_cfg, replace(inputs, schedule=schedule_of(PipelineName.plain.value)))
    moved = [
        a.name
        for a, b in zip(plan.tables, other.tables, strict=True)
        if (a.sharding_type, a.shards, a.replicated_rows)
        != (b.sharding_type, b.shards, b.replicated_rows)
    ]
    if moved or plan.batch_per_rank != other.batch_per_rank:
        log.info(
            "planner=%s priced pipeline=%s's schedule: its plan differs from the plain loop's "
            "(%d tables placed otherwise%s; batch shares %s vs %s), so the losses differ from "
            "a plain run's; under one plan they are equal (docs/pipelines.md)",
            plan.planner,
            cfg.pipeline.name.value,
            len(moved),
            f": {', '.join(moved[:4])}{' ...' if len(moved) > 4 else ''}" if moved else "",
            plan.batch_per_rank,
            other.batch_per_rank,
        )


def check_tables_fit(cfg: TrainConfig, inputs: PlanInputs) -> None:
    """PlanDoesNotFitError when the tables (weights and optimizer state) exceed the whole
    cluster's memory, whatever the plan: one message before any rank starts."""
    try:
        check_fits(inputs)
    except PlanDoesNotFitError as e:
        if not inputs.cpu:
            raise
        raise PlanDoesNotFitError(
            f"{e} To plan model={cfg.model.name} for a GPU cluster without training: "
            f"trainer.dry_run=true cluster=<a GPU layout, e.g. 1x8_a100_80g>."
        ) from None


def rank_main(ctx: RunContext, run_dir: str) -> dict:
    """What each rank of a training run runs (started by the launcher, an emulation or
    torchrun): its output to the command's log, then `recsys.trainer.loop.run_rank`."""
    rank_output_to_log()
    quiet_library_noise(ctx.cfg.trainer.log_level)
    # tqdm's default lock is a multiprocessing semaphore; ranks leave via os._exit (see
    # launch.exit_now), which would leak it. One process needs only a thread lock.
    tqdm.set_lock(threading.RLock())
    from recsys.trainer.loop import run_rank

    return run_rank(ctx, run_dir)


def plan_only(ctx: RunContext, run_dir: Path) -> dict:
    """Dry run: plan the model for the cluster on the meta device; no process group needed."""
    cfg = ctx.cfg
    if ctx.plan is not None:
        return {
            "dry_run": True,
            "world_size": len(ctx.ranks),
            "planner": cfg.planner.name.value,
            "plan_file": str(run_dir / "plan.json"),
            "est_step_ms": ctx.plan.est_step_ms,
        }
    model = build_model(cfg.model, dense_device=torch.device("meta"))
    plan = plan_with_torchrec(model, ctx.inputs, cfg.planner).plan
    (run_dir / "plan.txt").write_text(str(plan))
    return {
        "dry_run": True,
        "world_size": len(ctx.ranks),
        "compute_device": compute_device_type(ctx.ranks),
        "planner": cfg.planner.name.value,
        "plan_file": str(run_dir / "plan.txt"),
        "tables": len(cfg.model.num_embeddings_per_feature),
        "embedding_rows": sum(cfg.model.num_embeddings_per_feature),
    }


def to_typed(cfg: DictConfig | TrainConfig) -> TrainConfig:
    """The composed config as plain dataclasses (picklable for spawned ranks)."""
    if isinstance(cfg, TrainConfig):
        return cfg
    return to_object(cfg)


def train(cfg: DictConfig | TrainConfig, run_dir: str | Path | None = None) -> dict:
    """Run the job `cfg` describes; return rank 0's summary (also written to summary.json).
    Everything that can be checked is checked here, before any rank starts."""
    tcfg = _settled(to_typed(cfg))
    inputs = plan_inputs(tcfg, None, None)  # the cluster resolved, costs read: once, here
    _check_launch(tcfg, inputs)
    group_inputs(inputs, tcfg.trainer.sharding_group_size)  # 2D groups that fit the cluster
    emulate = tcfg.cluster.emulation.enabled and not tcfg.trainer.dry_run
    if emulate and not launch.launched_externally():
        from recsys.emulation import EmulationError, refuse_reason

        why = refuse_reason(tcfg.cluster)
        if why:  # before planning: one line, nothing made
            raise EmulationError(why)
    if tcfg.planner.name == PlannerName.torchrec and not tcfg.trainer.dry_run:
        # TorchRec plans inside the ranks: a model no plan can hold stops here
        check_tables_fit(tcfg, group_inputs(inputs, tcfg.trainer.sharding_group_size))
    run_dir = Path(run_dir or os.getcwd())
    preflight.check_outputs(tcfg, run_dir)
    run_id = _run_id(tcfg)
    with contextlib.ExitStack() as held:
        if not launch.launched_externally() or launch.external_rank_and_world()[0] == 0:
            # rank 0 holds the run directory and the checkpoint directory for the job
            held.enter_context(preflight.RunDirLock(run_dir, bool(tcfg.trainer.resume_from)))
            if _saves_checkpoints(tcfg):
                held.enter_context(
                    preflight.CheckpointDirLock(_checkpoint_root(tcfg, run_dir), run_id, run_dir)
                )
        return _train_in(tcfg, inputs, run_dir, emulate, run_id)


def _run_id(tcfg: TrainConfig) -> str:
    """This run's identity in its checkpoints: a resumed run keeps its checkpoint's."""
    resumed = checkpoint_run_id(tcfg.trainer.resume_from) if tcfg.trainer.resume_from else None
    return resumed or uuid.uuid4().hex[:16]


def _saves_checkpoints(tcfg: TrainConfig) -> bool:
    t = tcfg.trainer
    training = Mode(t.mode) == Mode.train and not t.dry_run
    return training and bool(t.save_checkpoint or t.checkpoint_every)


def _checkpoint_root(tcfg: TrainConfig, run_dir: Path) -> Path:
    return Path(tcfg.trainer.checkpoint_dir or run_dir / "checkpoints")


def _settled(tcfg: TrainConfig) -> TrainConfig:
    """The config checked (keys, model, checkpoint to resume, hotness) and with the planner
    keys a pipeline needs set, each change said in the log."""
    quiet_library_noise(tcfg.trainer.log_level)
    check_train_config(tcfg)
    validate_model_config(tcfg.model)
    if tcfg.trainer.resume_from:
        tcfg = _check_resume(tcfg)
    resolve_hotness(tcfg.dataset.hotness, len(tcfg.model.num_embeddings_per_feature))
    if tcfg.trainer.plan and tcfg.planner.name == PlannerName.torchrec:
        # a saved plan of ours trains in place of any planner; the run is named by the
        # plan's own planner once it is read
        tcfg = replace(tcfg, planner=replace(tcfg.planner, name=PlannerName.hybrid))
    if (
        tcfg.pipeline.name == PipelineName.semi_sync
        and tcfg.planner.name == PlannerName.torchrec
        and tcfg.planner.torchrec_data_parallel
    ):
        log.info(
            "pipeline=semi_sync: TorchRec's planner replicates no table "
            "(planner.torchrec_data_parallel=false; SemiSync cannot train them)"
        )
        tcfg = replace(tcfg, planner=replace(tcfg.planner, torchrec_data_parallel=False))
    return tcfg


def _check_resume(tcfg: TrainConfig) -> TrainConfig:
    """The checkpoint to resume, its files checked against its manifest, holds this model
    and is before trainer.max_steps; `trainer.resume_from` names it alone from here on (the
    ranks load it without reading every file again)."""
    ckpt = str(verified_checkpoint(tcfg.trainer.resume_from))
    tcfg = replace(tcfg, trainer=replace(tcfg.trainer, resume_from=ckpt))
    saved = saved_run(tcfg.trainer.resume_from)
    if saved is None or "model" not in saved:
        raise TrainConfigError(f"trainer.resume_from: {no_model_message(ckpt)}")
    now = json.loads(json.dumps(asdict(tcfg.model)))
    differs = first_model_difference(saved["model"], now)
    if differs:
        raise TrainConfigError(
            f"trainer.resume_from: the checkpoint holds another model ({differs}); resume "
            f"with the model it was saved with"
        )
    step = checkpoint_step(tcfg.trainer.resume_from)
    evaluating = Mode(tcfg.trainer.mode) == Mode.evaluate
    if step is not None and step >= tcfg.trainer.max_steps and not evaluating:
        raise TrainConfigError(
            f"trainer.resume_from: the checkpoint is at step {step}, at or past "
            f"trainer.max_steps={tcfg.trainer.max_steps}: nothing to train. Raise "
            f"trainer.max_steps, or evaluate it: python -m recsys.evaluate "
            f"trainer.resume_from={tcfg.trainer.resume_from}"
        )
    return tcfg


def _check_gpus(cluster: str, ranks: list) -> None:
    """A GPU cluster's ranks find their GPUs here: CUDA, as many GPUs as a node's ranks (each
    rank takes GPU `local_rank`), and one node when the local launcher starts them all."""
    if not torch.cuda.is_available():
        raise TrainConfigError(
            f"cluster '{cluster}' has GPUs and this machine has no CUDA: plan it with `python -m "
            f"sharding.plan cluster={cluster}` or trainer.dry_run=true, or train on CPU ranks "
            f"(cluster=local_cpu2)"
        )
    nodes = sorted({r.node for r in ranks})
    if len(nodes) > 1 and not launch.launched_externally():
        raise TrainConfigError(
            f"cluster '{cluster}' has {len(nodes)} nodes; the local launcher starts one "
            f"machine's ranks: start each node's with torchrun or Slurm (docs/launching.md)"
        )
    here = torch.cuda.device_count()
    per_node = max(sum(r.node == n for r in ranks) for n in nodes)
    if per_node > here:
        raise TrainConfigError(
            f"cluster '{cluster}' puts {per_node} GPU ranks on a node and this machine has "
            f"{here} GPU(s): name a cluster with at most {here} GPUs a node"
        )
    rank = launch.external_rank_and_world()[0] if launch.launched_externally() else 0
    for r in (r for r in ranks if r.node == ranks[rank].node):  # this machine's ranks
        if r.kind not in DEVICE_CATALOG:
            continue  # a device described by its figures: nothing to check its name against
        props = torch.cuda.get_device_properties(r.local_rank)
        found = gpu_kind(props.name, props.total_memory / 2**30)
        if found != r.kind:
            raise TrainConfigError(
                f"cluster '{cluster}' says GPU {r.local_rank} of this node is {r.kind}; it is "
                f"{props.name} ({found or 'not in the catalog'}): name a cluster that "
                f"matches, or describe the device by its figures (docs/clusters.md)"
            )


def _check_rehearsal(cluster: str, gpus: bool, inputs: PlanInputs) -> None:
    """A rehearsal needs a GPU cluster, and its tables in this machine's memory: all of
    them, once each, is the least its CPU ranks hold."""
    if not gpus:
        raise TrainConfigError(
            f"trainer.rehearse_on_cpu rehearses a GPU cluster's plan on CPU ranks; cluster "
            f"'{cluster}' is CPU ranks already: drop trainer.rehearse_on_cpu"
        )
    tables = sum(t.rows * t.dim * 4 for t in inputs.tables)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if tables > 0.8 * memory:
        raise TrainConfigError(
            f"trainer.rehearse_on_cpu: the tables alone take {tables / 2**30:.1f} GiB and this "
            f"machine has {memory / 2**30:.1f} GiB; rehearse a smaller model (model=..., "
            f"debug=tiny) on the same cluster"
        )


def _check_launch(tcfg: TrainConfig, inputs: PlanInputs) -> None:
    """The cluster's devices exist here (a rehearsal on CPU needs none, but the tables must
    fit this machine's memory), and torchrun or Slurm started one process per rank."""
    ranks = inputs.ranks
    gpus = compute_device_type(ranks) == "cuda"
    if tcfg.trainer.rehearse_on_cpu:
        _check_rehearsal(tcfg.cluster.name, gpus, inputs)
    elif gpus and not tcfg.trainer.dry_run:
        _check_gpus(tcfg.cluster.name, ranks)
    if launch.launched_externally() and not tcfg.trainer.dry_run:
        _, started = launch.external_rank_and_world()
        if started != len(ranks):
            raise TrainConfigError(
                f"cluster '{tcfg.cluster.name}' has {len(ranks)} ranks but {started} processes "
                f"were started (torchrun --nnodes x --nproc_per_node, or Slurm's tasks); start "
                f"{len(ranks)}, or name a cluster with {started} devices"
            )


def _train_in(
    tcfg: TrainConfig, inputs: PlanInputs, run_dir: Path, emulate: bool, run_id: str
) -> dict:
    """`train` once the config is checked and the run directory is this run's."""
    from recsys.trainer.outputs import write_summary

    ours = tcfg.planner.name != PlannerName.torchrec
    plan = plan_ours(tcfg, inputs, run_dir) if ours else None
    if plan is not None and plan.left_out and plan.cluster != tcfg.cluster.name:
        # the ranks train the part the plan is for
        keep = [r for r in range(inputs.world) if r not in plan.left_out]
        if launch.launched_externally():
            raise TrainConfigError(
                f"the {plan.planner} plan leaves ranks {plan.left_out} of {tcfg.cluster.name} "
                f"out, but torchrun or Slurm started every rank: start {len(keep)} with "
                f"cluster.only_ranks=[{','.join(map(str, keep))}] and trainer.plan=<its "
                f"plan.json>, or set planner.leave_out=false"
            )
        log.info(
            "the %s plan leaves ranks %s of %s out (predicted faster without them, "
            "plan.json's weighed): training on %d ranks",
            plan.planner,
            ", ".join(map(str, plan.left_out)),
            tcfg.cluster.name,
            len(keep),
        )
        tcfg, inputs = on_part(tcfg, inputs, keep)
    if plan is not None and tcfg.trainer.plan:  # the summary names the plan's planner
        tcfg = replace(tcfg, planner=replace(tcfg.planner, name=PlannerName(plan.planner)))
    if DenseAllreduce(tcfg.trainer.dense_allreduce) == DenseAllreduce.auto:
        tcfg = _resolve_auto_reduction(tcfg, inputs, plan)
    if plan is not None and plan.sharding_group_size != tcfg.trainer.sharding_group_size:
        # the plan chose 2D groups (planner.two_d, or a saved plan): the ranks train them
        trainer = replace(tcfg.trainer, sharding_group_size=plan.sharding_group_size)
        tcfg = replace(tcfg, trainer=trainer)
        check_train_config(tcfg)
    ctx = RunContext(tcfg, inputs, plan, run_id)
    world = len(ctx.ranks)
    if not tcfg.trainer.dry_run:
        preflight.check_data(tcfg, world, rank_shares(ctx.plan, world) if ours else None)
    writer = not launch.launched_externally() or launch.external_rank_and_world()[0] == 0
    if tcfg.trainer.dry_run:
        summary = plan_only(ctx, run_dir)
    else:
        try:
            summary = _launch(ctx, run_dir, emulate)
        except Exception as e:  # kept: what the run had, and the cause in one line
            if writer:
                _keep_failed_run(tcfg, run_dir, e, run_id)
            raise
    summary["run_dir"] = str(run_dir)
    if writer:
        log.info("summary written to %s", write_summary(run_dir, summary))
    return summary


def _launch(ctx: RunContext, run_dir: Path, emulate: bool) -> dict:
    """Start the ranks (locally, emulated, or this process under torchrun / Slurm) and
    return rank 0's results (this rank's under torchrun)."""
    tcfg = ctx.cfg.trainer
    if launch.launched_externally():
        summary = rank_main(ctx, str(run_dir))
        launch.shutdown_distributed(clean=True)
        return summary
    if emulate:
        return _train_emulated(ctx, run_dir)
    world = len(ctx.ranks)
    job = launch.spawn_ranks(
        rank_main,
        world,
        args=(ctx, str(run_dir)),
        timeout_s=tcfg.job_timeout_s,
        grace_s=tcfg.dist_timeout_s + 10,
    )
    return launch.raise_on_failure(job, f"training ({world} ranks)", run_dir / "train.log")[0]


def _keep_failed_run(tcfg: TrainConfig, run_dir: Path, error: Exception, run_id: str) -> None:
    """A run that failed once its ranks started keeps a summary naming the cause, the last
    checked step and the newest good checkpoint (`outputs.write_failed`); the error's
    message gains a line saying so."""
    from recsys.trainer.outputs import write_failed

    text = str(error).strip()
    cause = getattr(error, "first_failure", None) or (
        text.splitlines()[-1] if text else type(error).__name__
    )
    try:
        path = write_failed(run_dir, _checkpoint_root(tcfg, run_dir), cause, run_id)
    except Exception as e:  # noqa: BLE001 - the run's own error is the one to report
        kept = f"no summary could be written ({e})"
    else:
        summary = json.loads(path.read_text())
        last = summary["last_checkpoint"]
        step = summary["last_good_step"]
        kept = f"kept {path} ({f'losses checked to step {step}' if step else 'no step done'}); " + (
            f"last good checkpoint: {last}" if last else "no checkpoint"
        )
    if error.args and isinstance(error.args[0], str):
        error.args = (f"{error.args[0]}\n  {kept}", *error.args[1:])


def _train_emulated(ctx: RunContext, run_dir: Path) -> dict:
    """Every rank in its node's namespace and its own cpu cgroup (recsys/emulation.py);
    the summary adds `link_bytes`, what crossed between nodes during the whole job."""
    from recsys import emulation

    cfg = ctx.cfg
    with emulation.emulated(cfg.cluster) as emu:
        log.info(
            "emulated cluster '%s': %d nodes, %s between them, shares %s",
            cfg.cluster.name,
            emu.nodes,
            emulation.link_rate(cfg.cluster),
            [r.share for r in emu.ranks],
        )
        before = emu.link_bytes()
        job = emulation.run_ranks(
            emu,
            rank_main,
            args=(ctx, str(run_dir)),
            timeout_s=cfg.trainer.job_timeout_s,
            grace_s=cfg.trainer.dist_timeout_s + 10,
        )
        summary = launch.raise_on_failure(
            job, f"training ({len(emu.ranks)} emulated ranks)", run_dir / "train.log"
        )[0]
        summary["link_bytes"] = emu.link_bytes() - before
    return summary


register_configs()


def _user_errors() -> tuple[type[BaseException], ...]:
    """One line each, no traceback: the user's to fix, and a failed rank (its first cause is
    one line; the rank's traceback is in train.log)."""
    return (UserError, launch.RankFailedError)


def kept_after_interrupt(run_dir: Path) -> str:
    """What an interrupted run left: the summary so far (rank 0 writes it when stopped) and
    its last whole checkpoint."""
    path = run_dir / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return f"no summary was written (stopped before the first step); see {run_dir}"
    if "interrupted" not in summary:
        return f"the run had finished: {path}"
    last = summary.get("last_checkpoint")
    return f"kept the summary so far ({summary['steps_done']} steps): {path}; " + (
        f"last checkpoint: {last}" if last else "no checkpoint was saved"
    )


def _fmt(value: float | None, spec: str) -> str:
    """A figure for the printout; an undefined one (no eval, no timed steps) is n/a."""
    return "n/a" if value is None else format(value, spec)


EVALUATION_NOT_VALID = 3  # the exit status of a run whose held-out figures are undefined
FAILED_JOBS: list[str] = []  # the run directories of a sweep's failed jobs, in this process


def _record_failed_job(job_dir: Path, error: BaseException) -> None:
    """One job of a sweep (`-m`) failed: say so in its directory (failed.txt: the error,
    then the traceback) and on the console; the sweep goes on to the next job."""
    import traceback

    job_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(traceback.format_exception(error))
    (job_dir / "failed.txt").write_text(f"{type(error).__name__}: {error}\n\n{text}")
    first = getattr(error, "first_failure", "") or (
        str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    )
    print(f"job {job_dir.name} failed: {first} (see {job_dir / 'failed.txt'})", file=sys.stderr)
    FAILED_JOBS.append(str(job_dir))


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> float | None:
    # what this command and its ranks print also goes to its log; Ctrl-C or SIGTERM: the
    # ranks are stopped, then one line says what was kept
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    with command(lambda: f"every rank stopped; {kept_after_interrupt(run_dir)}"):
        return _main(cfg)


def _main(cfg: DictConfig) -> float | None:
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    try:
        summary = train(cfg, hydra_cfg.runtime.output_dir)
    except _user_errors() as e:  # a clear message, not a traceback from deep inside
        if hydra_cfg.mode == RunMode.MULTIRUN:
            _record_failed_job(Path(hydra_cfg.runtime.output_dir), e)
            if os.environ.get("SUBMITIT_EXECUTOR"):
                raise  # a Slurm job: its launcher learns of it from submitit, and fails too
            return None
        if not launch.launched_externally() or launch.external_rank_and_world()[0] == 0:
            print(f"error: {e}", file=sys.stderr)  # under torchrun: once, not once per rank
        sys.exit(1)
    except Exception as e:  # in a sweep, any failure is that job's; the others still run
        if hydra_cfg.mode != RunMode.MULTIRUN:
            raise
        _record_failed_job(Path(hydra_cfg.runtime.output_dir), e)
        if os.environ.get("SUBMITIT_EXECUTOR"):
            raise  # a Slurm job: its launcher learns of it from submitit, and fails too
        return None
    if summary.get("rank", 0) != 0:
        return None  # under torchrun / Slurm, rank 0 reports
    if summary.get("dry_run"):
        print(f"dry run: plan for {summary['world_size']} ranks written to {summary['plan_file']}")
        return None
    where = f"summary: {Path(summary['run_dir']) / 'summary.json'}"
    if summary.get("mode") == Mode.evaluate.value:
        print(
            f"{summary['eval_split']} AUC {_fmt(summary['eval_auc'], '.4f')} | log loss "
            f"{_fmt(summary['eval_logloss'], '.4f')} | NE {_fmt(summary['eval_ne'], '.4f')} | "
            f"{summary['eval_samples']:,} samples | checkpoint step {summary['checkpoint_step']} "
            f"on {summary['world_size']} ranks\n{where}"
        )
    else:
        print(
            f"eval AUC {_fmt(summary['eval_auc'], '.4f')} | eval log loss "
            f"{_fmt(summary['eval_logloss'], '.4f')} | NE {_fmt(summary['eval_ne'], '.4f')} | "
            f"train loss {_fmt(summary['train_loss'], '.4f')} "
            f"| {_fmt(summary['samples_per_s'], ',.0f')} samples/s on {summary['world_size']} "
            f"ranks ({summary['pipeline']})\n{where}"
        )
    if summary.get("eval_undefined"):  # the run finished; its evaluation is not a result
        print(f"error: the evaluation is not valid: {summary['eval_undefined']}", file=sys.stderr)
        if hydra_cfg.mode == RunMode.MULTIRUN:
            FAILED_JOBS.append(str(summary["run_dir"]))
            return None
        sys.exit(EVALUATION_NOT_VALID)
    return summary["eval_auc"]  # a sweeper's objective


def exit_status_of_sweep() -> int:
    """0, or the number of this sweep's failed jobs (at most 100), after naming them."""
    if not FAILED_JOBS:
        return 0
    print(f"{len(FAILED_JOBS)} sweep job(s) failed: " + ", ".join(FAILED_JOBS), file=sys.stderr)
    return min(len(FAILED_JOBS), 100)


# Hydra's options that print and exit: no rank starts
_HYDRA_INFO = {
    "-h",
    "--help",
    "--hydra-help",
    "--version",
    "-c",
    "--cfg",
    "-i",
    "--info",
    "-sc",
    "--shell-completion",
}


def cli(serve_forks: bool = False) -> None:
    """`python -m recsys.train`: the command, then its exit status (a sweep's: how many of
    its jobs failed). `serve_forks`: this process is the command's own, started by its entry
    module, and its ranks' fork server is to be forked from it now
    (`launch.serve_forks_from_here`)."""
    options = {arg.split("=", 1)[0] for arg in sys.argv[1:]}  # `--cfg=job` as `--cfg job`
    if serve_forks and not _HYDRA_INFO & options:  # ranks will start
        launch.serve_forks_from_here()
    main()
    if launch.launched_externally():  # torchrun / Slurm rank: see launch.exit_now
        launch.exit_now(0)
    sys.exit(exit_status_of_sweep())


if __name__ == "__main__":
    cli(serve_forks=True)


def evaluate_cli(serve_forks: bool = False) -> None:
    """`python -m recsys.evaluate`: the command with `trainer.mode=evaluate`, placed after
    Hydra's own options (`--config-dir <dir>`, ...; later arguments may not set another
    mode)."""
    flags = {"-m", "--multirun", "-r", "--run", "--resolve", "-h", "--help", "--hydra-help"}
    args, i = sys.argv, 1
    while i < len(args) and args[i].startswith("-"):  # an option, with its value if separate
        i += 1 if "=" in args[i] or args[i] in flags else 2
    args.insert(i, "trainer.mode=evaluate")
    cli(serve_forks)
