"""Every config schema of a training run (dataset, model, trainer, and the root), with the
checks that need no data, and their registration in Hydra's ConfigStore. Light on purpose:
it imports no TorchRec (the cluster, planner and pipeline schemas come from sharding.types
and pipelines.types).

Each config group's YAML files extend a schema registered here as `base_<group>`, so an
unknown key or a value of the wrong type fails at composition with the key's name.
`experiment/` and `debug/` files are `# @package _global_` deltas checked against the root.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf
from omegaconf.errors import MissingMandatoryValue

from pipelines.types import TWO_D_PIPELINES, PipelineConfig, PipelineName
from sharding.errors import UserError
from sharding.subsets import parse as parse_part
from sharding.subsets import part
from sharding.types import ClusterSpec, PlannerConfig

GROUPS = ("dataset", "model", "cluster", "planner", "pipeline", "trainer", "experiment", "debug")


class EvalSplit(str, Enum):
    """The held-out halves: prepared files hold out the last file (or
    `holdout_fraction` of one file), val its first half, test its second; synthetic data
    draws each from its own stream."""

    val = "val"
    test = "test"


@dataclass
class SyntheticConfig:
    """Synthetic Criteo-shaped data. Table sizes come from the model config."""

    name: str = "synthetic"
    zipf_exponent: float = 1.1  # p(k-th hottest row) ~ k^-exponent
    seed: int = 1234  # planted model and data stream; independent of trainer.seed
    # held-out batches per rank (files: at most the split's); null: the whole split (files)
    eval_batches: int | None = 16
    eval_split: EvalSplit = EvalSplit.val  # what evaluations read (files: val, then test)
    signal: float = 1.0  # scales the planted logit; 0 makes labels pure noise
    bias: float = -1.0  # planted intercept; about 30% positives at signal 1
    # ids per bag, one per table (0: empty bags), or "mlperf" (MLPerf DLRM-DCNv2's sizes);
    # null: one id per bag. Prepared files: written by `recsys.data.prepare hotness=...`
    hotness: Any = None


class DataKind(str, Enum):
    synthetic = "synthetic"  # generated in memory
    criteo = "criteo"  # binary files made by `python -m recsys.data.prepare`


@dataclass
class DatasetConfig(SyntheticConfig):
    """Synthetic fields (zipf_exponent, seed, signal, bias) apply to kind=synthetic."""

    kind: DataKind = DataKind.synthetic
    path: str | None = None  # kind=criteo: the directory `recsys.data.prepare` wrote
    holdout_fraction: float = 1 / 7  # one-file datasets: rows held out for val + test
    shuffle_chunk_batches: int = 16  # train batches are shuffled in chunks of this many
    make: str | None = None  # the command that makes the files at {path}, said when missing
    # prepared files: every row's label, dense features and ids checked before ranks start
    # (one read of the data); false skips it for data checked before
    check_values: bool = True


class Arch(str, Enum):
    """TorchRec's models (`torchrec.models`), each `model(dense, sparse) -> logits`."""

    dlrm = "dlrm"  # DLRM: dot interaction
    dcnv2 = "dcnv2"  # DLRM_DCN: low-rank DCN cross layers (MLPerf DLRM-DCNv2)
    projection = "projection"  # DLRM_Projection: dot interaction of two projected branches
    deepfm = "deepfm"  # SimpleDeepFMNN: factorization machine beside a deep interaction
    two_tower = "two_tower"  # query and candidate towers, their outputs' dot product


class TableDtype(str, Enum):
    fp32 = "fp32"
    fp16 = "fp16"


@dataclass
class ModelConfig:
    """Model shapes. `num_embeddings_per_feature` has one entry per categorical feature."""

    name: str = "dlrm_small"
    arch: Arch = Arch.dlrm
    embedding_dim: int = 16
    num_embeddings_per_feature: list[int] = field(default_factory=lambda: [1000] * 26)
    dense_in_features: int = 13
    dense_arch_layer_sizes: list[int] = field(default_factory=lambda: [64, 16])
    over_arch_layer_sizes: list[int] = field(default_factory=lambda: [64, 1])
    dcn_num_layers: int = 3
    dcn_low_rank_dim: int = 512
    # projection: each branch's MLP over the F + 1 pooled vectors; its last size a
    # multiple of embedding_dim (the branch's projected vectors)
    interaction_branch1_layer_sizes: list[int] = field(default_factory=lambda: [64, 64])
    interaction_branch2_layer_sizes: list[int] = field(default_factory=lambda: [64, 32])
    # deepfm: the deep interaction's output size (its dense arch is
    # dense_arch_layer_sizes = [hidden, embedding_dim], its over arch one linear layer)
    deep_fm_dimension: int = 8
    # two_tower: the first query_features categorical features (and the dense features,
    # through the dense arch) feed the query tower, the rest the candidate tower; both
    # towers are MLPs of tower_layer_sizes (over_arch_layer_sizes is not used)
    query_features: int = 13
    tower_layer_sizes: list[int] = field(default_factory=lambda: [64, 32])
    # what the tables store (TorchRec's DataType): fp16 halves their memory and the bytes
    # a lookup reads; lookups still return fp32, and the fused update rounds to fp16
    table_dtype: TableDtype = TableDtype.fp32


class ModelConfigError(UserError, ValueError):
    """Model shapes that cannot make a DLRM."""


def validate_model_config(cfg: ModelConfig) -> None:
    """Raise ModelConfigError naming the field when shapes cannot make a DLRM."""
    if not cfg.num_embeddings_per_feature or min(cfg.num_embeddings_per_feature) < 1:
        raise ModelConfigError(
            f"model '{cfg.name}': num_embeddings_per_feature needs rows >= 1 per table"
        )
    if cfg.embedding_dim < 1 or cfg.dense_in_features < 1:
        raise ModelConfigError(
            f"model '{cfg.name}': embedding_dim and dense_in_features must be >= 1"
        )
    if cfg.embedding_dim % 4:
        raise ModelConfigError(
            f"model.embedding_dim={cfg.embedding_dim}: TorchRec's fused tables (FBGEMM's TBE) "
            f"take a multiple of 4 columns per shard; use a multiple of 4 (e.g. "
            f"{max(4, cfg.embedding_dim // 4 * 4)}), and end dense_arch_layer_sizes with it"
        )
    if not cfg.dense_arch_layer_sizes or cfg.dense_arch_layer_sizes[-1] != cfg.embedding_dim:
        raise ModelConfigError(
            f"model '{cfg.name}': the last dense_arch_layer_sizes entry must equal embedding_dim "
            f"({cfg.embedding_dim}), got {list(cfg.dense_arch_layer_sizes)}"
        )
    if not cfg.over_arch_layer_sizes or cfg.over_arch_layer_sizes[-1] != 1:
        raise ModelConfigError(
            f"model '{cfg.name}': over_arch_layer_sizes must end in 1 (one logit), got "
            f"{list(cfg.over_arch_layer_sizes)}"
        )
    arch = Arch(cfg.arch)
    if arch == Arch.projection:
        for name in ("interaction_branch1_layer_sizes", "interaction_branch2_layer_sizes"):
            sizes = list(getattr(cfg, name))
            if not sizes or sizes[-1] % cfg.embedding_dim:
                raise ModelConfigError(
                    f"model '{cfg.name}' (arch=projection): {name}={sizes} must end in a "
                    f"multiple of embedding_dim ({cfg.embedding_dim}): the branch's output is "
                    f"that many projected vectors"
                )
    features = len(cfg.num_embeddings_per_feature)
    if arch == Arch.two_tower and not (0 < cfg.query_features < features and cfg.tower_layer_sizes):
        raise ModelConfigError(
            f"model '{cfg.name}' (arch=two_tower): query_features={cfg.query_features} must "
            f"leave each tower at least one of the {features} categorical features (1 to "
            f"{features - 1}), and tower_layer_sizes ({list(cfg.tower_layer_sizes)}) at least "
            f"one layer"
        )
    if arch == Arch.deepfm and (
        len(cfg.dense_arch_layer_sizes) != 2
        or list(cfg.over_arch_layer_sizes) != [1]
        or cfg.deep_fm_dimension < 1
    ):
        raise ModelConfigError(
            f"model '{cfg.name}' (arch=deepfm): TorchRec's SimpleDeepFMNN has a dense arch of "
            f"two layers (dense_arch_layer_sizes=[hidden, {cfg.embedding_dim}], got "
            f"{list(cfg.dense_arch_layer_sizes)}), one output layer (over_arch_layer_sizes="
            f"[1], got {list(cfg.over_arch_layer_sizes)}) and deep_fm_dimension >= 1"
        )


class DenseOptimizer(str, Enum):
    adagrad = "adagrad"
    sgd = "sgd"
    adam = "adam"


class DenseAllreduce(str, Enum):
    # fixed buckets every pipeline shares, started as backward fills them
    # (pipelines/dense_reduce.py): nested equals the plain loop at any world size
    buckets = "buckets"
    per_tensor = "per_tensor"  # the same, one bucket per gradient (one collective each)
    # the same buckets summed within each node, across nodes among the nodes' first ranks,
    # then sent back within the node: the slow link crossed once per node (one node: buckets)
    hierarchical = "hierarchical"
    # TorchRec's DDP (its own buckets, rebuilt after the first step); nested then has its own
    # buckets and equals the plain loop on 2 ranks only
    ddp_buckets = "ddp_buckets"
    # buckets or hierarchical, whichever the cost model prices faster: our planners plan
    # under both and keep the faster plan (plan.json's dense_allreduce); with TorchRec's
    # planner, the faster reduction of the dense parameters (sharding.plan_eval)
    auto = "auto"


class SparseOptimizer(str, Enum):
    rowwise_adagrad = "rowwise_adagrad"  # fused into FBGEMM's backward (EXACT_ROWWISE_ADAGRAD)
    sgd = "sgd"  # fused EXACT_SGD


class Mode(str, Enum):
    train = "train"
    # load trainer.resume_from and evaluate it on dataset.eval_split; nothing trains
    # (`python -m recsys.evaluate`)
    evaluate = "evaluate"


class Precision(str, Enum):
    """What the dense part (MLPs, interaction, DCN) computes in; tables and their updates
    stay fp32, parameters and their gradients too."""

    fp32 = "fp32"
    tf32 = "tf32"  # fp32 matmuls on tensor cores (GPU ranks; CPU ranks compute fp32)
    bf16 = "bf16"  # autocast: matmuls and activations in bf16, the logits back in fp32


@dataclass
class TrainerConfig:
    mode: Mode = Mode.train
    max_steps: int = 400
    batch_size: int = 1024  # per rank
    lr: float = 0.05  # dense optimizer
    embedding_lr: float = 0.05  # fused embedding optimizer
    dense_optimizer: DenseOptimizer = DenseOptimizer.adagrad
    sparse_optimizer: SparseOptimizer = SparseOptimizer.rowwise_adagrad
    eps: float = 1e-8
    # how dense gradients are averaged over ranks (docs/pipelines.md, "Bit for bit")
    dense_allreduce: DenseAllreduce = DenseAllreduce.buckets
    # 2D groups: the tables sharded over each group of this many consecutive ranks, the group
    # replicated, replicas summing row gradients before the update (pipelines/two_d.py;
    # docs/pipelines.md); 0: one group of every rank. A plan.json that chose 2D sets it
    sharding_group_size: int = 0
    seed: int = 0  # initial weights; the data has its own (dataset.seed)
    log_every: int = 20  # also how often losses are checked for NaN/inf
    eval_every: int = 0  # 0: evaluate once, at the end
    checkpoint_dir: str | None = None  # default: <run dir>/checkpoints
    checkpoint_every: int = 0  # 0: only at the end, and only if save_checkpoint
    save_checkpoint: bool = False
    resume_from: str | None = None  # a checkpoint dir, or a dir of step_* checkpoints
    # a plan.json (python -m sharding.plan, or a run's) trained as it is, not planned again
    plan: str | None = None
    # [first, last]: those steps (1-based) traced by torch.profiler, <run dir>/traces/rank<r>.json
    profile_steps: list[int] | None = None
    # TensorBoard scalars (loss, samples/s, eval AUC/NE/log loss) in <run dir>/tensorboard as
    # the run goes; None: where the tensorboard package is installed (the `tensorboard` extra)
    tensorboard: bool | None = None
    dist_timeout_s: float = 120.0  # every collective fails after this long, never hangs
    job_timeout_s: float = 24 * 3600.0  # the local spawner kills ranks still running then
    threads_per_rank: int = 0  # torch intra-op threads; 0: cores / local ranks
    # freed host memory kept for the next step, not given back to the kernel (host_memory.py)
    retain_host_memory: bool = True
    # training batches built ahead on a worker thread (pinned on GPU ranks); None: 2 on GPU
    # ranks, 0 on CPU ranks (where the thread would share the rank's core with its step)
    prefetch_batches: int | None = None
    precision: Precision = Precision.fp32  # the dense part's; the cost model prices it
    # a GPU cluster's plan trained on as many CPU ranks (gloo), each CUDA kernel replaced by
    # its CPU counterpart, through the GPU run's code path (docs/gpus.md)
    rehearse_on_cpu: bool = False
    warmup_steps: int = 5  # steps left out of samples/s
    progress_bar: bool = True  # a bar on a terminal; a line every tenth of the run otherwise
    log_level: str = "info"  # debug: also every library warning TorchRec and torch print
    dry_run: bool = False  # plan on the meta device, print the plan, train nothing


@dataclass
class TrainConfig:
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


def tensorboard_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


class TrainConfigError(UserError, ValueError):
    """A training config key with a value no run can use; the message names the key."""


def check_train_config(cfg: TrainConfig) -> None:
    """Every key a run reads that can be checked before any rank starts, each refused in one
    line naming it (the model's, the cluster's and the planner's own checks run beside)."""
    t = cfg.trainer
    lows = {
        "batch_size": 1,
        "max_steps": 1,
        "warmup_steps": 0,
        "log_every": 1,
        "eval_every": 0,
        "checkpoint_every": 0,
        "threads_per_rank": 0,
    }
    if t.prefetch_batches is not None:
        lows["prefetch_batches"] = 0
    for key, low in lows.items():
        value = getattr(t, key)
        if not value >= low:
            raise TrainConfigError(f"trainer.{key} must be >= {low}, got {value}")
    for key in ("lr", "embedding_lr", "eps", "dist_timeout_s", "job_timeout_s"):
        value = getattr(t, key)
        if not (math.isfinite(value) and value > 0):
            raise TrainConfigError(f"trainer.{key} must be a finite number > 0, got {value}")
    steps = t.profile_steps
    if steps is not None and (len(steps) != 2 or not 1 <= steps[0] <= steps[1] <= t.max_steps):
        raise TrainConfigError(
            f"trainer.profile_steps is [first, last], 1 <= first <= last <= trainer.max_steps "
            f"({t.max_steps}), got {list(steps)}"
        )
    if t.tensorboard and not tensorboard_installed():
        raise TrainConfigError(
            "trainer.tensorboard=true needs the tensorboard package: pip "
            "install -e '.[tensorboard]' (or leave it unset: written where "
            "installed)"
        )
    if t.log_level not in ("info", "debug"):
        raise TrainConfigError(f"trainer.log_level must be info or debug, got '{t.log_level}'")
    if t.sharding_group_size or cfg.planner.two_d:
        _check_two_d(cfg)
    if not cfg.pipeline.micro_batches >= 1:
        raise TrainConfigError(
            f"pipeline.micro_batches must be >= 1 (1: no micro-batches), got "
            f"{cfg.pipeline.micro_batches}"
        )
    eval_batches = cfg.dataset.eval_batches
    if eval_batches is None and DataKind(cfg.dataset.kind) == DataKind.synthetic:
        raise TrainConfigError(
            "dataset.eval_batches=null (the whole split) needs prepared files: synthetic data "
            "has no end; give a number of batches"
        )
    if eval_batches is not None and not eval_batches >= 0:
        raise TrainConfigError(
            f"dataset.eval_batches must be >= 0 (0: no evaluation; null: the "
            f"whole split), got {eval_batches}"
        )
    if Mode(t.mode) == Mode.evaluate:
        if not t.resume_from:
            raise TrainConfigError(
                "trainer.mode=evaluate needs trainer.resume_from=<a checkpoint directory, or a "
                "directory of step_* checkpoints>"
            )
        if eval_batches == 0:
            raise TrainConfigError(
                "trainer.mode=evaluate with dataset.eval_batches=0 has nothing to do; give a "
                "number of batches, or null for the whole split"
            )


def _check_two_d(cfg: TrainConfig) -> None:
    """What 2D groups (`trainer.sharding_group_size`, or `planner.two_d`'s choice) train
    with (pipelines/two_d.py)."""
    t = cfg.trainer
    what = "trainer.sharding_group_size" if t.sharding_group_size else "planner.two_d=true"
    if t.sharding_group_size < 0:
        raise TrainConfigError(
            f"trainer.sharding_group_size must be >= 0 (0: one group of every "
            f"rank), got {t.sharding_group_size}"
        )
    if cfg.planner.two_d and cfg.planner.name == "torchrec":
        raise TrainConfigError(
            "planner.two_d=true is for our planners (hybrid, greedy_size, round_robin); "
            "TorchRec's plans inside the ranks: give it trainer.sharding_group_size=<G> instead"
        )
    if PipelineName(cfg.pipeline.name) not in TWO_D_PIPELINES:
        raise TrainConfigError(
            f"{what} with pipeline={cfg.pipeline.name.value}: 2D groups train under "
            f"{', '.join(p.value for p in TWO_D_PIPELINES)} (the nested pipeline's exchanges "
            f"span every rank; semi_sync's stale lookups would miss the replicas' update)"
        )


def to_object(cfg: Any) -> Any:
    """A composed config as plain dataclasses; a required key left unset (a device's `kind`)
    is one line naming it."""
    try:
        obj = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as e:
        raise TrainConfigError(
            f"{e.full_key} is required and unset: give it in the config file or on the command "
            f"line (a device's kind: a catalog kind, or any name with its figures, "
            f"docs/clusters.md)"
        ) from None
    return _on_its_ranks(obj)


def cluster_overrides(name: str) -> list[str]:
    """The overrides that compose the cluster `name`: a preset, or a part of one
    (`<preset>@ranks_<r>_...`, `sharding.subsets`)."""
    found = parse_part(name)
    if found is None:
        return [f"cluster={name}"]
    base, keep = found
    return [f"cluster={base}", f"cluster.only_ranks=[{','.join(map(str, keep))}]"]


def _on_its_ranks(obj: Any) -> Any:
    """A config whose cluster names `only_ranks`, on that part of the cluster
    (`sharding.subsets`)."""
    if isinstance(obj, ClusterSpec):
        return part(obj)
    cluster = getattr(obj, "cluster", None)
    if isinstance(cluster, ClusterSpec) and cluster.only_ranks is not None:
        return dataclasses.replace(obj, cluster=part(cluster))
    return obj


def register_configs() -> None:
    # run directories: `${now:...}-${pid:}`, so two runs started in the same second differ
    if not OmegaConf.has_resolver("pid"):
        OmegaConf.register_new_resolver("pid", os.getpid)
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=TrainConfig)
    cs.store(group="dataset", name="base_dataset", node=DatasetConfig)
    cs.store(group="model", name="base_model", node=ModelConfig)
    cs.store(group="cluster", name="base_cluster", node=ClusterSpec)
    cs.store(group="planner", name="base_planner", node=PlannerConfig)
    cs.store(group="pipeline", name="base_pipeline", node=PipelineConfig)
    cs.store(group="trainer", name="base_trainer", node=TrainerConfig)
