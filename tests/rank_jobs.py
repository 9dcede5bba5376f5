"""Functions the launcher runs in spawned ranks (spawn imports them by module name)."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from recsys import launch


def all_reduce_rank(timeout_s: float) -> dict:
    rank, world = launch.init_distributed(timeout_s)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return {"rank": rank, "world": world, "sum": float(t), "parent": os.getppid()}


def reduce_scatters(timeout_s: float) -> dict:
    """TorchRec's row-wise reduce-scatter and `OrderedReduceScatter` on the same partial
    sums (each rank its own): each one's output and input gradient on even batches; on
    uneven ones (TorchRec's backward all-gather takes equal sizes only on gloo), ours
    and every rank's partials gathered and added in rank order."""
    from torchrec.distributed.dist_data import PooledEmbeddingsReduceScatter

    from pipelines.exchange import OrderedReduceScatter

    rank, world = launch.init_distributed(timeout_s)
    gen = torch.Generator().manual_seed(rank)
    out = {"rank": rank}
    for case, splits in (("even", [7] * world), ("uneven", [5 + 3 * r for r in range(world)])):
        local = torch.randn(sum(splits), 12, generator=gen) * 10 ** torch.randn(1, generator=gen)
        seed = torch.randn(splits[rank], 12, generator=gen)
        modules = {"ordered": OrderedReduceScatter(dist.group.WORLD)}
        if case == "even":
            modules["torchrec"] = PooledEmbeddingsReduceScatter(dist.group.WORLD)
        else:
            every = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(every, local)
            first = sum(splits[:rank])
            mine = [t[first : first + splits[rank]] for t in every]
            out["uneven_reference"] = sum(mine[1:], mine[0].clone()).numpy()
        for name, module in modules.items():
            x = local.clone().requires_grad_()
            y = module(x, input_splits=splits).wait()
            y.backward(seed)
            out[f"{case}_{name}"] = (y.detach().numpy(), x.grad.numpy())
    return out


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


def plans_sent_from_rank_zero(timeout_s: float) -> dict:
    """`collective_plan` three times: rank 0 makes a plan, fails to fit one, and makes one
    that cannot be pickled; what each rank got or raised, and how long each took."""
    from torchrec.distributed.types import ShardingPlan

    from sharding.torchrec_planner import collective_plan
    from sharding.types import PlanDoesNotFitError

    rank, _ = launch.init_distributed(timeout_s)

    def too_big() -> ShardingPlan:
        raise PlanDoesNotFitError("no plan fits: 3 GiB of tables on 1 GiB of memory")

    out = []
    for make in (lambda: ShardingPlan({"m": {}}), too_big, lambda: ShardingPlan({"m": lambda: 0})):
        start = time.monotonic()
        try:
            got = collective_plan(make, dist.group.WORLD)
            out.append(("plan", sorted(got.plan), time.monotonic() - start))
        except Exception as e:  # noqa: BLE001 - what the rank raised is the result
            out.append((type(e).__name__, str(e), time.monotonic() - start))
    return {"rank": rank, "results": out}


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
    from recsys.app.planning import run_context
    from recsys.app.train import rank_main

    _fault_at(3, 1, lambda: os._exit(17))
    return rank_main(run_context(cfg), run_dir)


def train_rank0_killed(cfg, run_dir: str) -> dict:
    """Rank 0 is SIGKILLed (the OOM killer's way): it reports nothing, its peer reports a
    lost connection first."""
    import signal

    from recsys.app.planning import run_context
    from recsys.app.train import rank_main

    _fault_at(3, 0, lambda: os.kill(os.getpid(), signal.SIGKILL))
    return rank_main(run_context(cfg), run_dir)


def train_rank_hangs(cfg, run_dir: str) -> dict:
    from recsys.app.planning import run_context
    from recsys.app.train import rank_main

    _fault_at(3, 1, lambda: time.sleep(3600))
    return rank_main(run_context(cfg), run_dir)


def _local_tensors(named, prefix: str = "") -> dict:
    """Every floating-point tensor this rank holds (its own shards of sharded ones), by name."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    out = {}
    for name, t in named.items():
        if isinstance(t, dict):
            out.update(_local_tensors(t, f"{prefix}{name}."))
        elif isinstance(t, ShardedTensor):
            for i, shard in enumerate(t.local_shards()):
                out[f"{prefix}{name}#{i}"] = shard.tensor.detach().cpu().numpy().copy()
        elif isinstance(t, DTensor):  # 2D groups' (TorchRec's ShardingEnv2D): the same keys
            local = t.to_local()
            shards = local.local_shards() if hasattr(local, "local_shards") else [local]
            for i, shard in enumerate(shards):
                out[f"{prefix}{name}#{i}"] = shard.detach().cpu().numpy().copy()
        elif isinstance(t, torch.Tensor) and t.is_floating_point():
            out[f"{prefix}{name}"] = t.detach().cpu().numpy().copy()
    return out


def _local_params(model, optimizer=None) -> dict:
    """The model's parameters and, with `optimizer`, its state (`optim.` names)."""
    out = _local_tensors(model.state_dict())
    if optimizer is not None:
        out.update(_local_tensors(optimizer.state_dict()["state"], "optim."))
    return out


def train_variants(
    cfgs: list,
    steps: int,
    run_dir: str,
    plans: list | None = None,
    stale: bool = False,
    shuffled: int = 0,
    shuffle: tuple[int, ...] = (0,),
) -> dict:
    """Train each config (with its plan of ours, or TorchRec's planner where None) for
    `steps` steps in this rank, one process group for all; return each run's per-step
    losses, final parameters (this rank's shards), pipeline stats and how many of TorchRec's
    DDP modules the model holds (`ddp_modules`). `stale`: the
    nested pipeline skips its refresh (a control: the results must then differ).
    `shuffled`: that many more runs of each config at an index in `shuffle` (after all the
    others, in that order), with each batch's samples in another order, each run its own
    (`benchmarks.order_noise`'s control: how far reordered sums alone go)."""
    if stale:
        from pipelines.lookups import Lookups

        Lookups.refresh = lambda *_: None
    from recsys.app.train import quiet_library_noise
    from recsys.trainer.loop import train_each

    quiet_library_noise()
    from recsys.app.planning import run_context

    todo = [
        (run_context(cfg, plan), None)
        for cfg, plan in zip(cfgs, plans or [None] * len(cfgs), strict=True)
    ]
    from pipelines.clustering import permute_batch

    def shuffler(seed: int):
        gen = torch.Generator().manual_seed(seed)
        return lambda b: permute_batch(b, torch.randperm(len(b.labels), generator=gen))

    todo += [
        (todo[i][0], shuffler(seed)) for i in shuffle if shuffled for seed in range(1, shuffled + 1)
    ]
    from torch.nn.parallel import DistributedDataParallel

    runs = []
    for job, losses in train_each(todo, steps, run_dir):
        stats = dict(getattr(job.pipeline, "stats", {}))
        params = _local_params(job.model, job.optimizer)
        # a sharded module keeps its lookups in a list: DDP there is not among modules()
        held = [
            *job.model.modules(),
            *(x for m in job.model.modules() for x in getattr(m, "_lookups", [])),
        ]
        ddp = sum(isinstance(m, DistributedDataParallel) for m in held)
        runs.append({"losses": losses, "params": params, "stats": stats, "ddp_modules": ddp})
    return {"rank": dist.get_rank(), "runs": runs}


def native_abort() -> None:
    """A rank that dies in native code, as gloo aborts on a collective mismatch: its message
    goes to fd 2, then SIGABRT."""
    from recsys.console import rank_output_to_log

    rank_output_to_log()
    print("python side: about to abort", file=sys.stderr, flush=True)
    os.write(2, b"terminate called: [enforce fail at pair.cc:456] collective mismatch\n")
    os.abort()


def train_slow_eval(cfg, run_dir: str) -> dict:
    """Every evaluation takes 0.5 s longer: what samples_per_s must leave out."""
    from recsys.app.planning import run_context
    from recsys.app.train import rank_main
    from recsys.trainer import loop as trainer

    original = trainer.evaluate

    def slow(*args, **kwargs):
        time.sleep(0.5)
        return original(*args, **kwargs)

    trainer.evaluate = slow
    return rank_main(run_context(cfg), run_dir)


# What a run works out once (docs/layout.md): counted in the parent and in every rank
COUNTED = (
    ("sharding.cluster", "resolve_cluster"),
    ("recsys.app.planning", "plan_inputs"),
    ("recsys.models.dlrm", "build_model"),
)


def count_calls(setattr_=setattr) -> dict[str, int]:
    """Wrap each COUNTED function wherever a loaded project module holds it; the returned
    dict counts the calls from then on. `setattr_`: pytest's monkeypatch.setattr, to undo."""
    import importlib

    counts: dict[str, int] = {}
    for module_name, name in COUNTED:
        original = getattr(importlib.import_module(module_name), name)
        counts[name] = 0

        def wrapper(*args, _original=original, _name=name, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)

        for module in list(sys.modules.values()):
            ours = getattr(module, "__name__", "").split(".")[0] in ("recsys", "sharding")
            if ours and getattr(module, name, None) is original:
                setattr_(module, name, wrapper)
    return counts


def counted_rank_main(ctx, run_dir: str) -> dict:
    """`rank_main`, with the rank's own COUNTED calls in its result (`calls`)."""
    import recsys.trainer.loop  # noqa: F401 - everything a rank loads, loaded before counting
    from recsys.app.train import rank_main

    counts = count_calls()
    summary = rank_main(ctx, run_dir)
    return summary | {"calls": dict(counts)}


def sharded_scores(cfg, plan, run_dir: str, batches: int) -> dict:
    """This rank's first `batches` batches of the eval split scored by the sharded model
    loaded from `cfg.trainer.resume_from` under `plan` (and its split): each batch as the data
    gives it (before the split tables' id remap) and the logits of the sharded model."""
    from recsys.app.planning import run_context
    from recsys.app.train import quiet_library_noise
    from recsys.checkpoint import load_checkpoint
    from recsys.trainer.build import build_training, rank_device

    quiet_library_noise()
    ctx = run_context(cfg, plan)
    rank, _ = launch.init_distributed(cfg.trainer.dist_timeout_s)
    device = rank_device(ctx.ranks[rank], False)
    job = build_training(ctx, run_dir, rank, device)
    load_checkpoint(cfg.trainer.resume_from, job.model, job.optimizer, job.dense_opt, job.layout)
    job.model.eval()
    out = []
    with torch.no_grad():
        for i, batch in enumerate(job.batches(cfg.dataset.eval_split, 0, batches)):
            raw = job.source.batch(cfg.dataset.eval_split, i, rank)
            _, (_, logits, _) = job.model(batch)
            kjt = raw.sparse_features  # numpy: tensors would go by file descriptors
            out.append(
                {
                    "dense": raw.dense_features.numpy(),
                    "labels": raw.labels.numpy(),
                    "keys": kjt.keys(),
                    "values": kjt.values().numpy(),
                    "lengths": kjt.lengths().numpy(),
                    "logits": logits.numpy(),
                }
            )
    hot_ids = {f: ids.numpy() for f, ids in job.remap.hot_ids.items()} if job.remap else {}
    return {"rank": rank, "batches": out, "hot_ids": hot_ids}


def library_planner_trains(timeout_s: float) -> dict:
    """A TorchRec user's script with `sharding.HybridPlanner` in place of TorchRec's
    planner: a DLRMTrain built on meta, planned collectively for the 2-rank local cluster,
    sharded by DistributedModelParallel, and trained a few steps at the plan's shares."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.datasets.utils import Batch
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.optim.keyed import KeyedOptimizerWrapper

    from sharding import api as sharding

    rank, world = launch.init_distributed(timeout_s)
    meta = torch.device("meta")
    rows = [500, 2000, 40]
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=n, feature_names=[f"f{i}"])
        for i, n in enumerate(rows)
    ]
    model = DLRMTrain(
        DLRM(
            embedding_bag_collection=EmbeddingBagCollection(tables, device=meta),
            dense_in_features=4,
            dense_arch_layer_sizes=[16, 8],
            over_arch_layer_sizes=[16, 1],
            dense_device=meta,
        )
    )
    sharders = [EmbeddingBagCollectionSharder()]
    planner = sharding.HybridPlanner("local_cpu2", batch_size=32)
    plan = planner.collective_plan(model, sharders, dist.group.WORLD)
    sharding.check_plan_paths(model, plan)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    opt = KeyedOptimizerWrapper(dict(dmp.named_parameters()), lambda p: torch.optim.SGD(p, 0.1))
    gen = torch.Generator().manual_seed(rank)
    batch = plan.batch_per_rank[rank]
    losses = []
    for _ in range(3):
        ids = torch.cat([torch.randint(0, n, (batch,), generator=gen) for n in rows])
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{i}" for i in range(len(rows))],
            values=ids,
            lengths=torch.ones(batch * len(rows), dtype=torch.int32),
        )
        b = Batch(
            dense_features=torch.randn(batch, 4, generator=gen),
            sparse_features=kjt,
            labels=torch.randint(0, 2, (batch,), generator=gen).float(),
        )
        loss, _ = dmp(b)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    sharded = type(dmp.module.model.sparse_arch.embedding_bag_collection).__name__
    return {"rank": rank, "losses": losses, "sharded": sharded, "shares": plan.batch_per_rank}
