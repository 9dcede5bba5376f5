"""The nested pipeline against the plain loop on 2 to 4 ranks: bit for bit across the matrix
of docs/pipelines.md, on our plans, column-wise and unequal shares, and the stale control."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import rank_jobs
import torch
import yaml
from conftest import CALIBRATION_2026_12_04, compose_config, plan_with_splits
from omegaconf import OmegaConf

from recsys.app.train import to_typed
from recsys.launch import raise_on_failure, spawn_ranks

STEPS = 10


# (micro-batches, clustering, lookahead with refresh, unique-row exchange): every N of the
# matrix, each mode on and off; dedup True: rows both ways (the order noise's bound), "fwd":
# rows forward, gradients pooled (bit for bit)
VARIANTS = [
    (1, False, False, False),
    (2, True, True, False),
    (3, False, False, False),
    (3, True, True, False),
    (4, False, False, False),
    (4, True, False, False),
    (4, False, True, False),
    (8, True, True, False),
    (4, False, False, True),
    (3, True, True, "fwd"),
]


def _nested(n: int, c: bool, lookahead: bool, dedup: bool | str = False) -> list[str]:
    return [
        "pipeline=nested",
        f"pipeline.micro_batches={n}",
        f"pipeline.cluster_samples={c}",
        f"pipeline.lookahead={lookahead}",
        f"pipeline.dedup={bool(dedup)}",
        f"pipeline.dedup_grads={dedup != 'fwd'}",
    ]


def _variant_configs(base: list[str], variants) -> list:
    """The plain config of `base`, then one per variant: what `compose_config(base +
    _nested(*v))` gives, composed twice instead of once per variant (a composition takes
    0.25 s; the variants differ only in the nested pipeline's values)."""
    nested = compose_config(base + ["pipeline=nested"])
    group = [to_typed(compose_config(base))]
    for v in variants:
        cfg = nested.copy()
        for override in _nested(*v)[1:]:
            key, value = override.split("=")
            OmegaConf.update(cfg, key, yaml.safe_load(value))
        group.append(to_typed(cfg))
    return group


def _deviation(run: dict, plain: dict) -> tuple[float, float]:
    """Largest relative loss difference, largest parameter difference over the tensor's
    largest value."""
    loss = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], plain["losses"], strict=True))
    params = max(
        float(np.abs(run["params"][k] - w).max()) / max(float(np.abs(w).max()), 1e-30)
        for k, w in plain["params"].items()
        if w.size
    )
    return loss, params


def _equal_to_plain(
    tmp_path: Path,
    base: list[str] | dict[str, list[str]],
    world: int,
    plan_of=None,
    variants=VARIANTS,
    exact: bool = True,
    aligned: bool = True,
    shuffles: int = 1,
    noise_factor: float = 2.0,
) -> None:
    """The plain loop, then nested in each variant, from the same seed: per-step losses, every
    parameter (each rank's shards) and the optimizers' state bit for bit (forward-only dedup
    too). Dedup both ways reorders the sums of a row's gradient, so it is held to the order
    noise of the same config: at most `noise_factor` times what the plain loop with each batch's
    samples shuffled differs by (`benchmarks.order_noise`'s control, run beside; with `shuffles`
    > 1, the largest of that many shuffles); so is clustering when a rank's batch is not a whole
    number of 32-sample units (`aligned=False`: the scalar tail of its last micro-batch holds
    other samples). `exact=False`: all within 1e-5. `base`: one config's overrides, or several
    by name, checked in one job (the ranks start once); `variants` then may be a list per name."""
    bases = base if isinstance(base, dict) else {"": base}
    of = variants if isinstance(variants, dict) else dict.fromkeys(bases, variants)
    # the shuffled control bounds only the variants held to the order noise
    noisy = any(dedup is True or (c and not aligned) for vs in of.values() for _, c, _, dedup in vs)
    shuffles = shuffles if exact and noisy else 0
    cfgs, plans, starts = [], [], []
    for name, b in bases.items():
        group = _variant_configs(b, of[name])
        starts.append(len(cfgs))
        cfgs += group
        # one plan for every run: a plan made per config could differ by the pipeline's schedule
        plans += [plan_of(group[0]) if plan_of else None] * len(group)
    job = spawn_ranks(
        rank_jobs.train_variants,
        world,
        args=(cfgs, STEPS, str(tmp_path), plans, False, shuffles, starts),
        timeout_s=600,
    )
    results = raise_on_failure(job, "nested vs plain")
    for g, (name, b) in enumerate(bases.items()):
        first = len(cfgs) + g * shuffles  # the shuffled plain runs come after all the others
        runs = [
            (
                r["rank"],
                r["runs"][starts[g] : starts[g] + 1 + len(of[name])],
                r["runs"][first : first + shuffles],
            )
            for r in results
        ]
        _check_runs(name, b, of[name], runs, exact, aligned, noise_factor)


def _check_runs(
    name: str,
    base: list[str],
    variants,
    runs: list[tuple[int, list[dict], list[dict]]],
    exact: bool,
    aligned: bool,
    noise_factor: float,
) -> None:
    """`_equal_to_plain`'s comparisons for one config: per rank, its plain run, its nested
    runs (one per variant) and its shuffled plain runs."""
    # the optimizers' state is compared too; only SGD everywhere has none
    state = not {"trainer.sparse_optimizer=sgd", "trainer.dense_optimizer=sgd"} <= set(base)
    multi_hot = any(o.startswith("dataset.hotness=") for o in base)
    # summed over ranks: a plan may leave a rank no model-parallel rows to refresh or send
    totals = {v: {"refreshed_bags": 0, "dedup_rows": 0, "dedup_bags": 0} for v in variants}
    for rank, (plain, *nested), shuffled in runs:
        assert state == any(k.startswith("optim.") for k in plain["params"])
        if exact and shuffled:
            noise = [_deviation(run, plain) for run in shuffled]
            noise_loss, noise_params = (max(x) for x in zip(*noise, strict=True))
        for (n, c, ahead, dedup), run in zip(variants, nested, strict=True):
            where = (
                f"{name + ', ' if name else ''}rank {rank}, N={n}, clustering={c}, "
                f"lookahead={ahead}, dedup={dedup}"
            )
            for key in totals[n, c, ahead, dedup]:
                totals[n, c, ahead, dedup][key] += run["stats"][key]
            assert run["params"].keys() == plain["params"].keys()
            if exact and dedup is not True and (aligned or not c):
                differ = {
                    key: float(np.abs(run["params"][key] - want).max())
                    for key, want in plain["params"].items()
                    if not np.array_equal(run["params"][key], want)
                }
                assert run["losses"] == plain["losses"] and not differ, (where, differ)
            elif exact:
                loss, params = _deviation(run, plain)
                bound_loss, bound_params = noise_factor * noise_loss, noise_factor * noise_params
                assert loss <= max(bound_loss, 2e-7), (where, loss, noise_loss)
                assert params <= max(bound_params, 1e-6), (where, params, noise_params)
            else:
                np.testing.assert_allclose(run["losses"], plain["losses"], rtol=1e-5, err_msg=where)
                for key, want in plain["params"].items():  # 1e-5 of the tensor's scale
                    scale = float(np.abs(want).max()) if want.size else 0.0
                    np.testing.assert_allclose(
                        run["params"][key],
                        want,
                        rtol=1e-5,
                        atol=1e-5 * scale,
                        err_msg=f"{where}: {key}",
                    )
    for (n, c, ahead, dedup), t in totals.items():
        where = (
            f"{name + ', ' if name else ''}N={n}, clustering={c}, lookahead={ahead}, "
            f"dedup={dedup}: {t}"
        )
        if ahead:  # the dual buffer was used: shared rows were really refreshed
            assert t["refreshed_bags"] > 0, where
        if dedup:  # unique rows moved, fewer than the pooled vectors they replace (one-hot)
            assert 0 < t["dedup_rows"] and (t["dedup_rows"] < t["dedup_bags"] or multi_hot), where


SGD = [
    "trainer.sparse_optimizer=sgd",
    "trainer.dense_optimizer=sgd",
    "trainer.lr=0.1",
    "trainer.embedding_lr=0.1",
]


ADAGRAD = ["trainer.sparse_optimizer=rowwise_adagrad", "trainer.dense_optimizer=adagrad"]


DCN = ["model.arch=dcnv2", "model.dcn_low_rank_dim=16"]
# bags of 0 to 20 ids over debug=tiny's 26 features, two always empty
MULTI_HOT = "dataset.hotness=[0,2,1,3,5,1,1,1,1,7,3,8,1,6,9,5,1,1,1,12,20,4,10,3,1,0]"
# each model's overrides of debug=tiny's DLRM (docs/training.md, "Models")
ARCHS = {
    "dlrm": [],
    "dcnv2": DCN,
    "projection": ["model.arch=projection"],
    "deepfm": ["model.arch=deepfm", "model.over_arch_layer_sizes=[1]"],
    "two_tower": ["model.arch=two_tower"],
}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_nested_is_bit_identical_to_the_plain_loop(tmp_path: Path, world) -> None:
    """The matrix of docs/pipelines.md: row-wise Adagrad embeddings, each dense optimizer
    on DLRM and DCNv2, dense Adagrad on DLRM_Projection, DeepFM and the two-tower model
    (DLRM_Projection and the two-tower model on 2 ranks; all pairs in one job), 2 and 3
    ranks (the default dense reduction: buckets both sides share),
    N = 1, 2, 3, 4, 8 with each mode on and off; 256 samples per rank, so every micro-batch
    is a whole number of 32-sample units. TorchRec's plan: data-parallel tables on 3 ranks,
    table-wise on 2."""
    bases = {}
    three = ("dlrm", "dcnv2", "deepfm")  # the others on 2 ranks only (suite time)
    for arch, model in (ARCHS if world == 2 else {a: ARCHS[a] for a in three}).items():
        for dense in ("sgd", "adagrad", "adam") if arch in ("dlrm", "dcnv2") else ("adagrad",):
            bases[f"{arch}-{dense}"] = [
                "debug=tiny",
                "trainer.batch_size=256",
                f"cluster.nodes.0.devices.0.count={world}",
                "trainer.sparse_optimizer=rowwise_adagrad",
                f"trainer.dense_optimizer={dense}",
                *model,
            ]
    # dedup's bound on 3 ranks: the largest of three shuffles (one shuffle's noise varies:
    # DCNv2 with Adam, dedup 4.4e-7 off where one shuffle was 8.6e-8 off)
    _equal_to_plain(
        tmp_path, bases, world, plan_of=_torchrec_default_plan, shuffles=3 if world > 2 else 1
    )


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_nested_is_bit_identical_with_multi_hot_and_empty_bags(tmp_path: Path, world) -> None:
    """Bags of 0 to 20 ids (two tables always empty): the lookups pool them, dedup counts
    each distinct id of a bag once; the same matrix holds, dedup's bound excepted: it
    regroups a row's gradient over the many bags of a micro-batch that share the row, more
    terms than a shuffle of the samples reorders. Measured on 2 ranks (10 steps): dedup's
    loss residual 1.8e-6 against 1.8e-7 to 8.1e-7 for three shuffles; held to 4x the largest
    of three (docs/pipelines.md)."""
    base = [
        "debug=tiny",
        "trainer.batch_size=256",
        f"cluster.nodes.0.devices.0.count={world}",
        *ADAGRAD,
        MULTI_HOT,
    ]
    variants = [
        (1, False, False, False),
        (3, True, True, False),
        (4, False, False, False),
        (8, True, True, False),
        (4, False, False, "fwd"),
        (2, True, True, True),
    ]
    _equal_to_plain(
        tmp_path,
        base,
        world,
        plan_of=_torchrec_default_plan,
        variants=variants,
        shuffles=3,
        noise_factor=4.0,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sharding", "nodes", "per_node"),
    [("row_wise", 1, 2), ("row_wise", 1, 3), ("table_row_wise", 1, 3), ("table_row_wise", 2, 2)],
)
def test_nested_is_bit_identical_on_row_wise_plans(
    tmp_path: Path, sharding, nodes, per_node
) -> None:
    """TorchRec's planner told one sharding type for a GPU cluster, the plan rehearsed on
    CPU ranks (`trainer.rehearse_on_cpu`). Row-wise: every table's rows in even blocks over
    all ranks, each rank's lookups partial sums for every rank's samples. Table-row-wise:
    each table's rows in blocks over one node's ranks, reduced within the node, then sent
    across nodes. Nested reduce-scatters chunk by chunk, summing in rank order as every
    pipeline does on CPU ranks (`pipelines.exchange.OrderedReduceScatter`), so the result
    is the plain loop's at any world size; one-hot and multi-hot bags, with clustering and
    the lookahead (dedup moves rows, which these owners do not send: refused at start,
    tested in test_nested_pieces). On 2 nodes also the hierarchical dense reduction (by
    node, then across nodes), which every pipeline shares too."""
    world = nodes * per_node
    base = [
        "debug=tiny",
        "trainer.batch_size=256",
        "cluster=2x8_h100",
        f"cluster.nodes.0.count={nodes}",
        f"cluster.nodes.0.devices.0.count={per_node}",
        "trainer.rehearse_on_cpu=true",
        f"planner.torchrec_sharding_types=[{sharding}]",
        *ADAGRAD,
    ]
    variants = [(3, True, True, False), (4, False, True, False), (8, True, False, False)]
    bases = {"one-hot": base, "multi-hot": [*base, MULTI_HOT]}
    if nodes > 1:
        bases["hierarchical"] = [*base, "trainer.dense_allreduce=hierarchical"]
    _equal_to_plain(tmp_path, bases, world, variants=variants)


@pytest.mark.parametrize("world", [2, 3])
def test_the_ordered_reduce_scatter_is_torchrecs_up_to_the_order_of_the_sum(world) -> None:
    """What every pipeline on CPU ranks reduces row-wise tables with: TorchRec's result
    within rounding and the same input gradient bit for bit (an all-gather, divided by the
    world size as TorchRec's); with uneven batches, the partials added in rank order."""
    job = spawn_ranks(rank_jobs.reduce_scatters, world, args=(30.0,), timeout_s=120)
    for r in raise_on_failure(job, "reduce-scatters"):
        (want, want_grad), (got, got_grad) = r["even_torchrec"], r["even_ordered"]
        assert got.shape == want.shape == (7, 12)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
        assert np.array_equal(got_grad, want_grad)
        got, _ = r["uneven_ordered"]
        assert got.shape == (5 + 3 * r["rank"], 12)
        assert np.array_equal(got, r["uneven_reference"])


def _torchrec_default_plan(cfg):
    """The plan TorchRec's planner makes with its default settings (capacities only):
    mostly table-wise. Pinned: under dense Adagrad the residual of reordered sums grows
    with the steps, and how far depends on the plan (see benchmarks.order_noise); this test
    keeps comparing the pipelines on the same plan."""
    import torch
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig

    from recsys.app.planning import plan_inputs
    from recsys.models.dlrm import build_model
    from sharding.plan_eval import evaluate
    from sharding.plan_shards import plan_from_layout, plan_layout

    inputs = plan_inputs(cfg, None, None)
    topology = TopologyFactory.create_topology(
        trainer_config=TrainerConfig(world_size=inputs.world, ddr_cap_bytes=2**29),
        kernel_config=KernelConfig(compute_device="cpu"),
    )
    model = build_model(cfg.model, dense_device=torch.device("meta"))
    plan = EmbeddingShardingPlanner(topology=topology, batch_size=cfg.trainer.batch_size).plan(
        model, [EmbeddingBagCollectionSharder()]
    )
    return evaluate(plan_from_layout("torchrec", plan_layout(plan), inputs), inputs)


def _our_plan(cfg):
    from recsys.app.planning import make_plan, plan_inputs

    return make_plan(cfg, plan_inputs(cfg, None, None))


@pytest.mark.slow
def test_nested_is_bit_identical_under_bf16_autocast(tmp_path: Path) -> None:
    """`trainer.precision=bf16`: the dense part in bf16 under autocast, micro-batches on
    whole bf16 vector units; the plain loop's losses and parameters bit for bit."""
    base = ["debug=tiny", "trainer.batch_size=256", "trainer.precision=bf16", *ADAGRAD]
    variants = [(2, True, True, False), (4, False, False, False), (3, True, False, False)]
    _equal_to_plain(tmp_path, base, 2, plan_of=_torchrec_default_plan, variants=variants)


@pytest.mark.slow
def test_nested_equals_the_plain_loop_on_a_hybrid_plan(tmp_path: Path) -> None:
    """Our plan with split tables: replicated hot rows (data-parallel, all-reduced with
    the dense layers), cold parts exchanged in chunks, the id remap in the data path. The
    cold parts as sequence tables (an EmbeddingCollection: each lookup's row moves, pooled
    by the model) and kept pooled, in one job. Planned under a pinned calibration: a new one
    moves hybrid's cuts, and with them the order noise dedup is held to."""
    base = [
        "planner=hybrid",
        "trainer.batch_size=128",
        "trainer.progress_bar=false",
        "trainer.dist_timeout_s=60",
        *ADAGRAD,
    ]
    plan = plan_with_splits(to_typed(compose_config(base)))
    assert any(0 < t.replicated_rows < t.rows for t in plan.tables), "no split table"
    assert any(s.sparse_exchange for t in plan.tables for s in t.shards), "no sequence part"
    bases = {
        "sequence": [*base, "planner.cold_only_exchange=true"],
        "pooled": [*base, "planner.cold_only_exchange=false"],
    }
    # every exchanged table of this plan is split, so with sequence cold parts dedup has
    # no pooled table to move
    variants = {"sequence": [v for v in VARIANTS if not v[3]], "pooled": VARIANTS}
    _equal_to_plain(tmp_path, bases, 2, plan_of=lambda _: plan, variants=variants)


def _column_wise_plan(cfg):
    """Our plan with its first table cut in two column halves on ranks 0 and 1."""
    from sharding.plan_eval import finish_table
    from sharding.types import Shard

    plan = _our_plan(cfg)
    t = plan.tables[0]
    half = t.dim // 2
    t.replicated_rows = 0
    t.shards = [Shard(t.name, 0, t.rows, half), Shard(t.name, 1, t.rows, t.dim - half)]
    finish_table(t)
    assert t.sharding_type == "column_wise" and t.ranks == [0, 1]
    return plan


@pytest.mark.slow
def test_nested_equals_the_plain_loop_on_a_column_wise_plan(tmp_path: Path) -> None:
    """A table in two column shards: each owner's chunks (pooled, or its distinct rows with
    dedup) carry half of its columns."""
    base = ["debug=tiny", "planner=round_robin", *SGD]  # whole tables, one of them then cut
    _equal_to_plain(tmp_path, base, 2, plan_of=_column_wise_plan)


@pytest.mark.slow
def test_nested_equals_the_plain_loop_with_unequal_batch_shares(tmp_path: Path) -> None:
    """The speed-skewed cluster: each rank its own batch size, so micro-batch k is a
    different number of samples on each rank, not whole 32-sample units; dense gradients
    reduced one tensor at a time (`trainer.dense_allreduce=per_tensor`). Beside it, in the
    same job, hybrid's sequence cold parts with bags of 0 to 20 ids."""
    base = [
        "debug=tiny",
        "planner=hybrid",
        "planner.leave_out=false",  # unequal shares on every rank: the point here
        "cluster=local_cpu3_skewed",
        "trainer.dense_allreduce=per_tensor",
        CALIBRATION_2026_12_04,
        *SGD,
    ]
    sequence = [*base, "planner.cold_only_exchange=true", MULTI_HOT]
    bases = {"pooled": [*base, "planner.cold_only_exchange=false"], "sequence, multi-hot": sequence}
    for b in bases.values():
        plan = _our_plan(to_typed(compose_config(b)))
        shares = plan.batch_per_rank
        assert len(set(shares)) > 1 and any(b % 32 for b in shares), shares
    assert any(s.sparse_exchange for t in plan.tables for s in t.shards), "no sequence part"
    variants = {"pooled": VARIANTS, "sequence, multi-hot": [v for v in VARIANTS if not v[3]]}
    _equal_to_plain(tmp_path, bases, 3, plan_of=_our_plan, variants=variants, aligned=False)


@pytest.mark.slow
def test_nested_trains_column_wise_tables_whose_output_torchrec_permutes(tmp_path: Path) -> None:
    """Hybrid's plan for 4 skewed ranks cuts tables into column pieces on shared ranks, so
    TorchRec permutes the exchanged columns (an output callback); nested applies it to each
    chunk and is bit for bit the plain loop (it refused the plan at start before)."""
    base = [
        "debug=tiny",
        "planner=hybrid",
        "planner.cold_only_exchange=false",
        "planner.leave_out=false",  # unequal shares on every rank: the point here
        "cluster=local_cpu3_skewed",
        "cluster.nodes.0.devices.0.count=3",
        *SGD,
    ]
    plan = _pinned_plan(to_typed(compose_config(base)))
    pieces = [t for t in plan.tables if t.sharding_type == "column_wise" and len(t.shards) > 1]
    assert len(pieces) >= 2, [(t.name, t.sharding_type, len(t.shards)) for t in plan.tables]
    variants = [(2, False, False, False), (4, True, True, False), (3, False, False, True)]
    _equal_to_plain(tmp_path, base, 4, plan_of=lambda _: plan, variants=variants, aligned=False)


def _pinned_plan(cfg):
    """Hybrid's placement at its speed shares (`_hybrid`: column pieces on shared ranks,
    before the whole-table replication and shape searches, which under the model of
    2026-12-07 replicate or merge every piece of this tiny model) under the calibration this
    test was written against (2026-12-02, `tests/data/`). Pinned as `_torchrec_default_plan`
    is: a later calibration or model moves hybrid's cuts (that of 2026-12-04 puts pieces of
    two widths on a rank, which dedup refuses in one line)."""
    from recsys.app.planning import plan_inputs
    from sharding.calibration import load_calibration
    from sharding.hybrid import HybridOptions, _hybrid, speed_batch
    from sharding.plan_eval import evaluate

    cal = load_calibration(Path(__file__).parents[1] / "data" / "local_cpu_2026-12-02.json")
    inputs = plan_inputs(cfg, None, None, cal)
    return evaluate(_hybrid(inputs, speed_batch(inputs), HybridOptions()), inputs, bound=False)


@pytest.mark.slow
def test_without_the_refresh_the_lookahead_is_stale(tmp_path: Path) -> None:
    """The control: skip the dual-buffer refresh and batch i+1 trains on rows from before
    batch i's update; the losses leave the plain loop's (so the equality tests can fail)."""
    base = ["debug=tiny", *ADAGRAD]  # row-wise Adagrad moves rows far in one step
    cfgs = [to_typed(compose_config(base + o)) for o in ([], _nested(2, False, True))]
    job = spawn_ranks(
        rank_jobs.train_variants, 2, args=(cfgs, 8, str(tmp_path), None, True), timeout_s=300
    )
    plain, stale = raise_on_failure(job, "stale control")[0]["runs"]
    assert stale["losses"][0] == pytest.approx(plain["losses"][0], rel=1e-6)  # nothing yet
    diff = max(
        abs(a - b) / abs(a) for a, b in zip(plain["losses"][1:], stale["losses"][1:], strict=True)
    )
    params = {
        n: float(np.abs(stale["params"][n] - p).max() / np.abs(p).max())
        for n, p in plain["params"].items()
    }
    assert diff > 1e-4 and max(params.values()) > 1e-2


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nested_equals_the_plain_loop_on_gpus(tmp_path: Path) -> None:
    """The CUDA path: NCCL collectives, the lookahead on a side stream (one rank per GPU)."""
    world = min(2, torch.cuda.device_count())
    base = [
        "debug=tiny",
        "cluster=1x8_a100_80g",
        f"cluster.nodes.0.devices.0.count={world}",
        "pipeline.lookahead=true",
        *ADAGRAD,
    ]
    _equal_to_plain(tmp_path, base, world, exact=False)  # not measured on a GPU yet


@pytest.mark.slow
def test_more_micro_batches_than_samples_on_some_ranks(tmp_path: Path) -> None:
    """Shares 48, 48, 96 with N=64: ranks 0 and 1 have empty micro-batches while rank 2's
    are not; their exchanges still run (no hang) and the result is the plain loop's."""
    base = [
        "debug=tiny",
        "planner=hybrid",
        "planner.cold_only_exchange=false",
        "planner.leave_out=false",  # unequal shares on every rank: the point here
        "cluster=local_cpu3_skewed",
        *SGD,
    ]
    cfgs = [to_typed(compose_config(base + o)) for o in ([], _nested(64, False, False))]
    plan = _our_plan(cfgs[0])  # one plan for both: the pipeline differs
    assert min(plan.batch_per_rank) < 64 < max(plan.batch_per_rank)
    job = spawn_ranks(
        rank_jobs.train_variants, 3, args=(cfgs, 4, str(tmp_path), [plan] * 2), timeout_s=300
    )
    for result in raise_on_failure(job, "empty micro-batches"):
        plain, nested = result["runs"]
        np.testing.assert_allclose(nested["losses"], plain["losses"], rtol=1e-5)


@pytest.mark.slow
def test_every_rank_issues_its_collectives_in_one_order_whatever_its_share(
    tmp_path: Path,
) -> None:
    """Shares [24, 24, 48] (batch 32) and [2, 1, 3] (batch 2, down to one sample): ranks
    0 and 1 have an empty micro-batch 0 where rank 2 does not, for every N. A rank skipping
    the next batch's id exchange after an empty micro-batch 0 ran its collectives in
    another order than its peers (gloo aborted; NCCL would hang or mix data)."""
    common = [
        "debug=tiny",
        "planner=hybrid",
        "planner.cold_only_exchange=false",
        "planner.leave_out=false",  # unequal shares on every rank: the point here
        "cluster=local_cpu3_skewed",
        *SGD,
    ]
    bases = {f"batch {b}": [*common, f"trainer.batch_size={b}"] for b in (32, 2)}
    shares = {n: _our_plan(to_typed(compose_config(b))).batch_per_rank for n, b in bases.items()}
    assert shares == {"batch 32": [24, 24, 48], "batch 2": [2, 1, 3]}, shares
    variants = [(n, False, False, False) for n in (1, 2, 3, 4, 8)]
    _equal_to_plain(tmp_path, bases, 3, plan_of=_our_plan, variants=variants, aligned=False)


@pytest.mark.slow
def test_nested_through_the_trainer_with_evals_between_steps(tmp_path: Path) -> None:
    """`recsys.train pipeline=nested` with evaluations between training steps (the next
    batch is already prefetched then): the same losses and AUCs as the plain loop."""
    from recsys.app.train import train

    common = ["debug=tiny", "trainer.max_steps=8", "trainer.eval_every=3"]
    plain = train(compose_config(common), tmp_path / "plain")
    nested = train(compose_config(common + _nested(2, True, True)), tmp_path / "nested")
    assert nested["pipeline"] == "nested" and len(nested["evals"]) == 2
    assert nested["step_losses"] == pytest.approx(plain["step_losses"], rel=1e-5)
    for a, b in zip(plain["evals"], nested["evals"], strict=True):
        assert b["eval_auc"] == pytest.approx(a["eval_auc"], rel=1e-5)
    assert nested["eval_auc"] == pytest.approx(plain["eval_auc"], rel=1e-5)


@pytest.mark.slow
def test_dedup_trains_when_every_bag_is_empty(tmp_path: Path) -> None:
    """`dataset.hotness` all 0: no id to send (dedup concatenated an empty list), and the
    embeddings add nothing, so nested with dedup gives the plain loop's losses exactly."""
    from recsys.app.train import train

    common = ["debug=tiny", "trainer.max_steps=4", f"dataset.hotness=[{','.join(['0'] * 26)}]"]
    plain = train(compose_config(common), tmp_path / "plain")
    dedup = train(compose_config(common + _nested(2, False, False, True)), tmp_path / "dedup")
    assert dedup["pipeline"] == "nested" and dedup["step_losses"] == plain["step_losses"]


def test_data_parallel_tables_are_reduced_in_the_shared_buckets(tmp_path: Path) -> None:
    """The default reduction takes the data-parallel tables out of TorchRec's DDP
    (`SharedReduction.take_tables`) and averages them with the dense gradients: on 3 ranks
    under TorchRec's plan (which replicates the small tables) the replicas stay equal bit
    for bit, and they train as TorchRec's own DDP trains them (`ddp_buckets`) up to the
    order of the sums; the plain loop and nested alike."""
    base = ["debug=tiny", "trainer.batch_size=256", "cluster.nodes.0.devices.0.count=3", *ADAGRAD]
    cfgs = [
        to_typed(compose_config(o))
        for o in (
            base,
            [*base, "trainer.dense_allreduce=ddp_buckets"],
            [*base, "pipeline=nested", "pipeline.micro_batches=4"],
        )
    ]
    plan = _torchrec_default_plan(cfgs[0])
    job = spawn_ranks(
        rank_jobs.train_variants, 3, args=(cfgs, STEPS, str(tmp_path), [plan] * 3), timeout_s=600
    )
    ranks = raise_on_failure(job, "data-parallel tables")
    params = ranks[0]["runs"][0]["params"]  # replicated: whole, not shards (`#i`)
    tables = [k for k in params if ".embedding_bags." in k and "#" not in k and "optim." not in k]
    assert tables, "TorchRec's plan replicated no table"
    for run in range(3):  # every rank holds the same replicas
        first = ranks[0]["runs"][run]["params"]
        for k in tables:
            assert all(np.array_equal(r["runs"][run]["params"][k], first[k]) for r in ranks), k
    # TorchRec's DDP wraps the tables' lookups (and the dense part) only under ddp_buckets
    assert [run["ddp_modules"] for run in ranks[0]["runs"]] == [0, 2, 0]
    shared, ddp, nested = (ranks[0]["runs"][i]["params"] for i in range(3))
    for k in tables:
        np.testing.assert_allclose(shared[k], ddp[k], rtol=1e-5, atol=1e-6)
        assert np.array_equal(nested[k], shared[k]), k
