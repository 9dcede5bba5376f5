"""`python -m benchmarks.pipeline`: train pipelines side by side across a rate-limited link.

Two ranks in two network namespaces joined by a veth pair limited by tbf (`link_rate`,
chosen so that the plain loop spends about half its step waiting on the link), and the
same runs again over a fast link (`fast_rate`; `fast_link=false` skips them, halving the
runs): the difference of a pipeline's step time between the two is the communication it
leaves exposed. Every run trains the same plan
from the same seed, so each pipeline's per-step losses are compared with the plain
loop's (`equal_to_plain`: within 1e-5 relative at every step; `bit_identical`: equal).
A second row set trains multi-hot bags (`multi_hot`, MLPerf DLRM-DCNv2's sizes by
default). Beside the runs, the key-centric clustering's effect on distinct ids per
micro-batch, from the same data. Needs root.
"""

from __future__ import annotations

import csv
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from benchmarks import netns, plots
from benchmarks.calibrate import measured_ms, predict_ms, refresh_calibration
from benchmarks.common import (
    BenchTrainer,
    benchmark_command,
    emulated_preset,
    environment,
    finish,
    parse_label,
    results_dir_for,
    start,
    train_emulated,
)
from recsys import CONF_DIR
from recsys.config import register_configs
from sharding.calibration import CalibrationError, load_calibration
from sharding.types import ClusterSpec

EQUAL_RTOL = 1e-5
# TorchRec's pipelines whose steps use this batch's embeddings (no staleness)
TORCHREC_EXACT = ("sparse_dist", "sparse_dist_lite", "fused_sparse_dist")
# TorchRec 1.9.2's pipelines this benchmark does not run, and why (in summary.json and the table)
NOT_RUN = {
    "pec": "TrainPipelinePEC trains ShardedPECEmbeddingCollection modules only (sequence "
    "embeddings, sharded row-wise; the benchmark's models pool bags and nested exchanges "
    "sequence tables table-wise), and it records torch.cuda.Event on its data-dist stream "
    "every step, which needs a CUDA device (measured: 'Found no NVIDIA driver')",
    "prefetch_sparse_dist": "PrefetchTrainPipelineSparseDist prefetches UVM-cached tables, "
    "which need CUDA",
}


@dataclass
class PipelineBenchConfig:
    # a pipeline name, or nested<N> with optional +lookahead / +cluster / +dedup (unique
    # rows both ways: within rounding) or +dedup_fwd (unique rows forward: bit for bit)
    pipelines: list[str] = field(
        default_factory=lambda: [
            "plain",
            "base",
            "sparse_dist",
            "sparse_dist_lite",
            "fused_sparse_dist",
            "semi_sync",
            "nested1",
            "nested2",
            "nested4",
            "nested8",
            "nested4+lookahead",
            "nested4+cluster",
            "nested4+dedup",
            "nested8+dedup",
            "nested4+dedup+cluster",
            "nested4+dedup_fwd",
            "nested8+dedup_fwd",
        ]
    )
    # round_robin: whole tables, table-wise. TorchRec's planner also replicates small
    # tables (data-parallel), which TorchRec's SemiSync cannot train (see README).
    # Dense SGD: a run whose losses are not chaotic, so equality can be checked at every
    # step (with the default dense Adagrad this run's plain loop alone moves by 1e-2 when
    # only the order of samples within each batch changes); row-wise Adagrad embeddings,
    # which make a stale lookup visible in the losses
    overrides: list[str] = field(
        default_factory=lambda: [
            "trainer.batch_size=2048",
            "planner=round_robin",
            "trainer.dense_optimizer=sgd",
            "trainer.lr=0.1",
        ]
    )
    steps: int = 60
    # the main row set's runs, on each link: this many rounds, every pipeline once a round
    # (interleaved, so drift on the machine hits all alike); each pipeline's median run is
    # its row, every run's samples/s listed (`samples_per_s_runs`)
    repeats: int = 3
    link_rate: str = "700mbit"
    # tbf's burst; null: the link's own, which gives chunked transfers no credit
    # (netns.HONEST_BURST for the veth pair, the emulated cluster's emulation.burst)
    link_burst: str | None = None
    # the probe's chunk: nested4's share of this config's exchange (2048 samples x 13
    # tables x 16 floats a rank, in 4 micro-batches)
    probe_chunk_bytes: int = 2048 * 13 * 16 * 4 // 4
    fast_rate: str = "20gbit"
    fast_link: bool = True  # False: no fast-link runs (no exposed communication; half the time)
    # the headline's sensitivity to the burst: these pipelines at each burst
    burst_sensitivity: list[str] = field(default_factory=lambda: ["24kb", "64kb", "256kb"])
    sensitivity_pipelines: list[str] = field(default_factory=lambda: ["sparse_dist", "nested4"])
    cluster_batches: int = 20  # batches for the distinct-ids-per-micro-batch measurement
    # the multi-hot row set: these pipelines again with dataset.hotness=<multi_hot>
    # (a bag size per table, or "mlperf"); null: no multi-hot rows
    multi_hot: Any = "mlperf"
    multi_hot_pipelines: list[str] = field(
        default_factory=lambda: [
            "plain",
            "sparse_dist",
            "sparse_dist_lite",
            "fused_sparse_dist",
            "semi_sync",
            "nested4",
            "nested4+dedup",
            "nested4+dedup_fwd",
        ]
    )
    # the second plan's row set: these overrides after `overrides` (TorchRec's planner told
    # row_wise only for two GPUs, the plan rehearsed on the CPU ranks: every table's rows in
    # two blocks, each rank's lookups partial sums for both ranks' samples, reduce-scattered);
    # null: no second plan; not run on an emulated cluster (cluster=)
    row_wise: list[str] | None = field(
        default_factory=lambda: [
            "planner=torchrec",
            "planner.torchrec_sharding_types=[row_wise]",
            "cluster=1x8_a100_80g",
            "cluster.nodes.0.devices.0.count=2",
            "trainer.rehearse_on_cpu=true",
        ]
    )
    row_wise_pipelines: list[str] = field(
        default_factory=lambda: [
            "plain",
            "sparse_dist",
            "sparse_dist_lite",
            "fused_sparse_dist",
            "semi_sync",
            "nested2",
            "nested4",
            "nested8",
            "nested4+lookahead",
            "nested4+cluster",
        ]
    )
    # cluster=<an emulated preset> (emu_mixed4): train on it instead of the 2-rank veth pair;
    # its own inter-node rate is the slow link (link_rate unused), fast_rate the fast one
    cluster: ClusterSpec | None = None
    trainer: BenchTrainer = field(default_factory=BenchTrainer)
    # predict with the per-core rates re-measured at the start (about a minute;
    # benchmarks.calibrate.refreshed), not the saved calibration's
    recalibrate: bool = False
    save: bool = False  # also write benchmarks/results/ (see common.output_dirs)
    results_dir: str = ""  # "": benchmarks/results/pipeline, pipeline_<preset> with cluster=


def pipeline_overrides(label: str) -> list[str]:
    """`nested4+lookahead` -> pipeline=nested with N=4 and the lookahead on; other labels
    are pipeline names (nested variants default to no lookahead, no clustering, no dedup)."""
    p = parse_label(label)
    if p.name != "nested":
        return [f"pipeline={p.name}"]
    overrides = [
        "pipeline=nested",
        f"pipeline.micro_batches={p.micro_batches}",
        f"pipeline.lookahead={'lookahead' in p.options}",
        f"pipeline.cluster_samples={'cluster' in p.options}",
        f"pipeline.dedup={p.dedup}",
    ]
    return overrides + ([] if p.dedup_grads else ["pipeline.dedup_grads=False"])


def _losses(run_dir: Path) -> list[float]:
    with open(run_dir / "train_losses.csv") as f:
        return [float(row["loss"]) for row in csv.DictReader(f)]


def _max_rel_diff(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        return float("inf")
    return max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True))


def _emulated_overrides(rate: str | None, burst: str) -> list[str]:
    """The emulated cluster at `rate` (None: its own) with tbf burst `burst`."""
    where = [f"cluster.emulation.burst={burst}"]
    if rate is not None:
        where.append(f"cluster.network.inter_node_gbit_s={netns.rate_bits(rate) / 1e9:g}")
    return where


@contextmanager
def _trainer(cfg: PipelineBenchConfig, rate: str | None, burst: str) -> Iterator[Callable]:
    """`train(overrides, steps, run_dir) -> (link bytes, summary)` across the link."""
    if cfg.cluster:
        where, name = _emulated_overrides(rate, burst), emulated_preset(cfg.cluster, "pipeline")
        yield lambda overrides, *a: train_emulated(name, [*where, *overrides], *a)
        return
    with netns.veth_link(rate or cfg.link_rate, burst=burst) as link:
        yield partial(netns.train_pair, link)


def _predicted_ms(
    cfg: PipelineBenchConfig, overrides: list[str], run_dir: Path, cal=None
) -> float | None:
    """The cost model's step time for the run's plan and pipeline, where the calibration
    (`cal`, or the saved one) has its link (the emulated cluster's own; a veth pair only at a
    calibrated rate)."""
    name = emulated_preset(cfg.cluster, "pipeline")
    where = [f"cluster={name}"] if name else []
    link = name or f"veth_{cfg.link_rate}"
    try:
        return predict_ms([*where, *overrides], run_dir, link, cal or load_calibration())
    except CalibrationError:  # not calibrated
        return None


def _train_all(
    cfg: PipelineBenchConfig,
    rate: str | None,
    burst: str,
    tmp: Path,
    pipelines: list[str],
    extra: tuple[str, ...] = (),
    tag: str = "",
    repeats: int = 1,
    cal=None,
) -> dict[str, dict]:
    """Every pipeline across the slow link (rate None: the configured one) or `rate`, each
    run in its own directory under `tmp` (a burst the sensitivity sweep repeats included);
    `extra` overrides after the configured ones, for the row set `tag` ("": the main one).
    With `repeats`, that many rounds of every pipeline, each pipeline's fastest run kept
    (and whether its losses were the same every round). The cost model's prediction beside
    the main and multi-hot sets (the row-wise set's GPU plan rehearsed on CPU ranks is not
    what it prices); `cal`: the calibration it predicts with (None: the saved one)."""
    runs: dict[str, list[dict]] = {label: [] for label in pipelines}
    steps = cfg.trainer.max_steps or cfg.steps
    tmp = Path(tempfile.mkdtemp(prefix=f"{rate}_{burst}_", dir=tmp))
    with _trainer(cfg, rate, burst) as train:
        for rep in range(repeats):
            for label in pipelines:
                run_dir = tmp / f"{rate}_{burst}_{label}_{rep}{'_' + tag if tag else ''}"
                overrides = [*cfg.overrides, *extra, *pipeline_overrides(label)]
                sent, summary = train(overrides, steps, run_dir)
                losses = _losses(run_dir)
                runs[label].append(
                    {
                        "summary": summary,
                        "bytes": sent,
                        "bytes_by_direction": summary.get("link_bytes_by_direction"),
                        "dir": run_dir,
                        "losses": losses,
                        "overrides": overrides,
                    }
                )
                print(
                    f"{rate or 'slow link'} burst {burst} {label}"
                    f"{f' (round {rep + 1}/{repeats})' if repeats > 1 else ''}: "
                    f"{summary['samples_per_s']:,.0f} samples/s",
                    flush=True,
                )
    out = {}
    predict = rate is None and tag != "row_wise"
    for label, done in runs.items():
        ranked = sorted(done, key=lambda r: r["summary"]["samples_per_s"])
        best = ranked[(len(ranked) - 1) // 2]  # the median run (the lower of two)
        out[label] = {
            "summary": best["summary"],
            "bytes": best["bytes"],
            "bytes_by_direction": best["bytes_by_direction"],
            "losses": best["losses"],
            "runs": [r["summary"]["samples_per_s"] for r in done],
            "same_losses_every_round": all(r["losses"] == best["losses"] for r in done),
            "predicted_ms": _predicted_ms(cfg, best["overrides"], best["dir"], cal)
            if predict
            else None,
        }
    return out


def link_report(cfg: PipelineBenchConfig, burst: str) -> dict:
    """The link as the runs see it: the rate a chunked transfer with idle gaps achieves
    (chunks the size nested4 sends) over the nominal rate; across the emulated cluster's
    first two nodes with `cluster`."""
    if cfg.cluster:
        from recsys import emulation

        spec = replace(cfg.cluster, emulation=replace(cfg.cluster.emulation, burst=burst))
        rate_name = emulation.link_rate(spec)
        with emulation.emulated(spec) as emu:
            n = (0, 1)
            link = netns.VethLink(
                tuple(map(emu.node_ns, n)),
                tuple(map(emu.address, n)),
                tuple(map(emu.node_if, n)),
                rate_name,
            )
            achieved = netns.chunked_rate(link, cfg.probe_chunk_bytes, gap_s=0.005, chunks=32)
    else:
        rate_name = cfg.link_rate
        with netns.veth_link(cfg.link_rate, burst=burst) as link:
            achieved = netns.chunked_rate(link, cfg.probe_chunk_bytes, gap_s=0.005, chunks=32)
    rate = netns.rate_bits(rate_name)
    return {
        "rate_mbit": rate / 1e6,
        "burst_bytes": netns.size_bytes(burst),
        "chunked_rate_ratio": achieved / rate,
    }


def clustering_stats(cfg: PipelineBenchConfig) -> list[dict]:
    """Distinct ids per micro-batch, with and without clustering, on the benchmark's data
    (rank 0's batches); and the bytes each micro-batch's embeddings take: the pooled
    exchange sends one vector per sample and feature either way, the unique-row exchange
    (dedup) one per distinct (feature, id)."""
    from pipelines.clustering import cluster_order, distinct_ids_per_micro_batch, permute_kjt
    from recsys.app.train import to_typed
    from recsys.data.source import build_source

    typed = to_typed(hydra.compose(config_name="config", overrides=cfg.overrides))
    source = build_source(typed.dataset, typed.model, typed.trainer.batch_size, 2)
    features = len(typed.model.num_embeddings_per_feature)
    rows = []
    for n in (2, 4, 8):
        plain = clustered = 0
        for i in range(cfg.cluster_batches):
            kjt = source.batch("train", i, 0).sparse_features
            plain += sum(distinct_ids_per_micro_batch(kjt, n))
            clustered += sum(
                distinct_ids_per_micro_batch(permute_kjt(kjt, cluster_order(kjt, n)), n)
            )
        per = cfg.cluster_batches * n
        row_bytes = typed.model.embedding_dim * 4
        pooled = typed.trainer.batch_size / n * features * row_bytes
        rows.append(
            {
                "micro_batches": n,
                "distinct_ids": plain / per,
                "distinct_ids_clustered": clustered / per,
                "unique_row_bytes": row_bytes * plain / per,
                "unique_row_bytes_clustered": row_bytes * clustered / per,
                "pooled_bytes": pooled,
            }
        )
    return rows


def _own_burst(cfg: PipelineBenchConfig) -> str:
    return cfg.cluster.emulation.burst if cfg.cluster else netns.HONEST_BURST


def run(cfg: PipelineBenchConfig) -> dict:
    why_not = netns.available()
    if why_not:
        raise SystemExit(f"benchmarks.pipeline {why_not}")
    if cfg.burst_sensitivity and "sparse_dist" not in cfg.sensitivity_pipelines:
        raise SystemExit(
            "benchmarks.pipeline: sensitivity_pipelines must include sparse_dist "
            "(the speed-ups are against it), or set burst_sensitivity=[]"
        )
    if cfg.link_burst is None:
        cfg = replace(cfg, link_burst=_own_burst(cfg))
    sensitivity, multi, row_wise = {}, None, None
    cal = refresh_calibration() if cfg.recalibrate else None  # the cores' speed today
    with tempfile.TemporaryDirectory() as tmp:
        link = link_report(cfg, cfg.link_burst)
        rows = _row_set(cfg, Path(tmp), cfg.pipelines, (), "", cal)
        for burst in cfg.burst_sensitivity:
            runs = _train_all(cfg, None, burst, Path(tmp), cfg.sensitivity_pipelines)
            speeds = {p: r["summary"]["samples_per_s"] for p, r in runs.items()}
            sensitivity[str(netns.size_bytes(burst))] = {
                "chunked_rate_ratio": link_report(cfg, burst)["chunked_rate_ratio"],
                "speedup_vs_sparse_dist": speedups(speeds, "sparse_dist"),
            }
        if cfg.multi_hot is not None:
            extra = (f"dataset.hotness={_hydra_value(cfg.multi_hot)}",)
            multi = _row_set(cfg, Path(tmp), cfg.multi_hot_pipelines, extra, "multi_hot", cal)
        if cfg.row_wise is not None and cfg.cluster is None:  # a two-GPU plan: the veth pair
            extra = tuple(cfg.row_wise)
            row_wise = _row_set(cfg, Path(tmp), cfg.row_wise_pipelines, extra, "row_wise")
    steps = cfg.trainer.max_steps or cfg.steps
    for row_set in (rows, multi, row_wise):
        add_wire_limits(row_set or [], link, steps)
    main = _summary(rows)
    result = {
        "pipelines": {r["pipeline"]: r["samples_per_s"] for r in rows},
        "exposed_comm_ms": {r["pipeline"]: r["exposed_comm_ms"] for r in rows},
        "equal_to_plain": {r["pipeline"]: r["equal_to_plain"] for r in rows},
        **main,
        "link": link,
        "burst_sensitivity": sensitivity,
        "clustering": clustering_stats(cfg),
        "multi_hot": None if multi is None else {"hotness": cfg.multi_hot, **_summary(multi)},
        "plans": _plans(cfg, main, row_wise),
        "not_run": NOT_RUN,
        # the predictions' per-core rates: re-measured at the start, against the saved ones
        "calibration_refreshed": None if cal is None else cal.measured["refreshed"]["vs_saved"],
        "config": OmegaConf.to_container(OmegaConf.structured(cfg)),
        "environment": environment(),
    }
    return result


def _row_set(
    cfg: PipelineBenchConfig,
    tmp: Path,
    pipes: list[str],
    extra: tuple[str, ...],
    tag: str,
    cal=None,
) -> list[dict]:
    """A row set (`pipes` with `extra` overrides) on the slow and the fast link; the main
    set ("" tag) `cfg.repeats` times on each."""
    repeats = cfg.repeats if not tag else 1
    slow = _train_all(cfg, None, cfg.link_burst, tmp, pipes, extra, tag, repeats, cal)
    fast = (
        _train_all(cfg, cfg.fast_rate, cfg.link_burst, tmp, pipes, extra, tag, repeats)
        if cfg.fast_link
        else None
    )
    return _rows(pipes, slow, fast)


def _plans(cfg: PipelineBenchConfig, main: dict, row_wise: list[dict] | None) -> dict:
    """Each benchmark plan: its overrides, its pipelines' samples/s and its summary (the
    main plan's rows are the result's own `rows`)."""

    def entry(overrides: list[str], summary: dict) -> dict:
        pipelines = {r["pipeline"]: r["samples_per_s"] for r in summary["rows"]}
        return {"overrides": list(overrides), "pipelines": pipelines, **summary}

    main = {k: v for k, v in entry(cfg.overrides, main).items() if k != "rows"}
    if row_wise is None:
        return {"main": main}
    return {"main": main, "row_wise": entry(cfg.row_wise, _summary(row_wise))}


def _hydra_value(value) -> str:
    return value if isinstance(value, str) else f"[{','.join(str(int(h)) for h in value)}]"


def _rows(pipelines: list[str], slow: dict, fast: dict | None) -> list[dict]:
    """One row per pipeline: its speed on the slow link, and the exposed communication
    (the slow link's step minus the fast one's; None without `fast`), its losses against
    the plain loop's."""
    plain_losses = slow["plain"]["losses"] if "plain" in slow else None
    rows = []
    for label in pipelines:
        s = slow[label]["summary"]
        fast_ms = measured_ms(fast[label]["summary"]) if fast else None
        diff = _max_rel_diff(plain_losses, slow[label]["losses"]) if plain_losses else None
        rows.append(
            {
                "pipeline": label,
                "samples_per_s": s["samples_per_s"],
                "samples_per_s_runs": slow[label]["runs"],
                "same_losses_every_round": slow[label]["same_losses_every_round"],
                "step_ms": measured_ms(s),
                "fast_link_step_ms": fast_ms,
                "measured_ms": measured_ms(s),
                "predicted_ms": slow[label].get("predicted_ms"),
                "exposed_comm_ms": None if fast_ms is None else measured_ms(s) - fast_ms,
                "link_bytes": slow[label]["bytes"],
                "link_bytes_by_direction": slow[label].get("bytes_by_direction"),
                "max_rel_loss_diff_vs_plain": diff,
                "equal_to_plain": diff is not None and diff <= EQUAL_RTOL,
                "bit_identical": diff == 0.0,
                "eval_auc": s["eval_auc"],
                # nested: ms per step spent waiting on ids, chunks, gradients, the all-reduce
                "wait_ms_per_step": (s.get("pipeline_stats") or {}).get("wait_ms_per_step"),
                # each rank's CPU a step and, on an emulated cluster, its share of CFS periods
                # out of quota (what a quota-bound rank spent and how often it ran dry)
                "cpu_ms_per_step_by_rank": s.get("cpu_ms_per_step_by_rank"),
                "quota_throttled_share_by_rank": s.get("quota_throttled_share_by_rank"),
            }
        )
    return rows


def _summary(rows: list[dict]) -> dict:
    """The speed-ups over sparse_dist, semi_sync and the fastest staleness-free TorchRec
    pipeline that ran, and the setting's overlap limit with each row's step over it."""
    by = {r["pipeline"]: r for r in rows}
    best = max(
        (by[p] for p in TORCHREC_EXACT if p in by), key=lambda r: r["samples_per_s"], default=None
    )
    limit = overlap_limit_ms(by)
    for r in rows:
        r["over_overlap_limit"] = None if limit is None else r["step_ms"] / limit
    return {
        "rows": rows,
        "speedup_vs_sparse_dist": _speedups(rows, "sparse_dist"),
        "speedup_vs_semi_sync": _speedups(rows, "semi_sync"),
        "best_torchrec_exact": best
        and {"pipeline": best["pipeline"], "samples_per_s": best["samples_per_s"]},
        "speedup_vs_best_torchrec_exact": {}
        if best is None
        else {
            r["pipeline"]: r["samples_per_s"] / best["samples_per_s"]
            for r in rows
            if r["pipeline"].startswith("nested")
        },
        # each ratio's spread: a pipeline's run against the other's run of the same round
        "speedup_vs_sparse_dist_range": _ranges(rows, by.get("sparse_dist")),
        "speedup_vs_best_torchrec_exact_range": _ranges(
            [r for r in rows if r["pipeline"].startswith("nested")], best
        ),
        "overlap_limit_ms": limit,
        # against the physical limit (`add_wire_limits`): a step no schedule can beat
        "over_wire_limit": {
            r["pipeline"]: r["over_wire_limit"] for r in rows if r.get("over_wire_limit")
        },
        "plain_comm_share": _comm_share(by),
    }


def add_wire_limits(rows: list[dict], link: dict, steps: int) -> None:
    """Each row's step against the physical limit of its own traffic: the bytes the busier
    direction of the link carried a step (the interface counters over the run's steps; the
    run's setup and its one evaluation batch are counted too, so the figure errs high), the
    time they take at the rate a chunked transfer measured on this link, and
    `max(compute alone, wire)`: the plain loop's step over the fast link (no schedule
    computes less) or that wire time (none sends faster). Rows without the counters of each
    direction (an emulated cluster's) or without the plain loop's fast-link run get none."""
    plain = next((r for r in rows if r["pipeline"] == "plain"), None)
    compute_ms = None if plain is None else plain["fast_link_step_ms"]
    bytes_per_s = link["rate_mbit"] * 1e6 / 8 * link["chunked_rate_ratio"]
    for r in rows:
        sides = r.get("link_bytes_by_direction")
        if not sides or compute_ms is None:
            continue
        per_step = max(sides) / steps
        wire_ms = 1e3 * per_step / bytes_per_s
        r["wire_bytes_per_step"] = per_step
        r["wire_ms"] = wire_ms
        r["compute_alone_ms"] = compute_ms
        r["wire_limit_ms"] = max(compute_ms, wire_ms)
        r["over_wire_limit"] = r["step_ms"] / r["wire_limit_ms"]


def overlap_limit_ms(by: dict[str, dict]) -> float | None:
    """The step no pipeline can beat on this link: the longer of the plain loop's compute
    alone (its step over the fast link) and its exchange alone (its step here less that);
    None without the plain loop's fast-link run."""
    plain = by.get("plain")
    if plain is None or plain["fast_link_step_ms"] is None:
        return None
    return max(plain["fast_link_step_ms"], plain["exposed_comm_ms"])


def speedups(pipelines: dict[str, float], base: str) -> dict[str, float]:
    """Each pipeline's samples/s over `base`'s ({} when `base` did not run)."""
    if base not in pipelines:
        return {}
    return {p: speed / pipelines[base] for p, speed in pipelines.items()}


def _ranges(rows: list[dict], base: dict | None) -> dict[str, list[float]]:
    """Per row, [min, max] over rounds of its samples/s over `base`'s in the same round."""
    if base is None:
        return {}
    out = {}
    for r in rows:
        pairs = zip(r["samples_per_s_runs"], base["samples_per_s_runs"], strict=True)
        ratios = [a / b for a, b in pairs]
        out[r["pipeline"]] = [min(ratios), max(ratios)]
    return out


def _speedups(rows: list[dict], base: str) -> dict[str, float]:
    return speedups({r["pipeline"]: r["samples_per_s"] for r in rows}, base)


def _comm_share(by: dict[str, dict]) -> float | None:
    """The share of the plain loop's step spent on the link (None without fast-link runs)."""
    plain = by.get("plain")
    if plain is None or plain["exposed_comm_ms"] is None:
        return None
    return plain["exposed_comm_ms"] / plain["step_ms"]


def _row_lines(rows: list[dict], speedups: dict) -> list[str]:
    lines = [
        "| pipeline | samples/s | vs sparse_dist | step ms | exposed comm ms | "
        "link MB (run) | equal to plain (max rel loss diff) | waits ms/step: ids, "
        "chunks, gradients, all-reduce | step / overlap limit | MB a step, busier direction | "
        "wire ms | step / max(compute alone, wire) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in rows:
        speed, diff = speedups.get(x["pipeline"]), x["max_rel_loss_diff_vs_plain"]
        equal = "-"  # no plain loop in the runs: nothing to compare with
        if diff is not None:
            same = "yes" if x["equal_to_plain"] else "no"
            verdict = "bit for bit" if x["bit_identical"] else same
            equal = f"{verdict} ({diff:.1e})"
        lines.append(
            f"| {x['pipeline']} | {x['samples_per_s']:,.0f} | "
            f"{f'{speed:.2f}x' if speed else '-'} | {x['step_ms']:.1f} | "
            f"{_ms(x['exposed_comm_ms'])} | {x['link_bytes'] / 1e6:.2f} | "
            f"{equal} | {_waits(x.get('wait_ms_per_step'))} | "
            f"{_times(x.get('over_overlap_limit'))} | "
            f"{_mb(x.get('wire_bytes_per_step'))} | {_ms(x.get('wire_ms'))} | "
            f"{_times(x.get('over_wire_limit'))} |"
        )
    return lines


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:.2f}"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _headline(m: dict) -> list[str]:
    """The fastest staleness-free TorchRec pipeline, nested against it, the overlap limit."""
    lines = []
    best = m.get("best_torchrec_exact")
    if best:
        spread = m.get("speedup_vs_best_torchrec_exact_range", {})
        vs = ", ".join(
            f"{p} {x:.2f}x" + (f" ({spread[p][0]:.2f}-{spread[p][1]:.2f})" if p in spread else "")
            for p, x in m["speedup_vs_best_torchrec_exact"].items()
        )
        lines.append(
            f"Fastest staleness-free TorchRec pipeline: {best['pipeline']} "
            f"({best['samples_per_s']:,.0f} samples/s); against it: {vs or '-'}."
        )
    if m.get("overlap_limit_ms") is not None:
        lines.append(
            f"Overlap limit: {m['overlap_limit_ms']:.1f} ms (the longer of the plain "
            f"loop's compute alone, its fast-link step, and its exchange alone: a reference "
            f"that keeps the plain loop's use of the link, not a bound)."
        )
    if m.get("over_wire_limit"):
        lines.append(
            "Physical limit, per pipeline: max(compute alone, wire), the wire time of the "
            "bytes the busier direction carried a step at the chunked transfers' measured "
            "rate; against it: "
            + ", ".join(f"{p} {x:.2f}x" for p, x in m["over_wire_limit"].items())
            + "."
        )
    return [*lines, ""] if lines else []


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _waits(w: dict | None) -> str:
    return (
        ", ".join(
            f"{w[k]:.1f}" for k in ("ids", "chunks", "gradients", "dense_allreduce") if k in w
        )
        if w
        else "-"
    )


def _rounds(c: dict) -> str:
    n = c.get("repeats", 1)
    return (
        f"; main rows: each pipeline's median of {n} interleaved runs per link, the ranges "
        "each run against the other's run of the same round"
        if n > 1
        else ""
    )


def table(r: dict) -> str:
    env, c = r["environment"], r["config"]
    share = r["plain_comm_share"]
    where = (
        f"on the emulated cluster {c['cluster']['name']}"
        if c.get("cluster")
        else f"across a {c['link_rate']} veth link, 2 ranks"
    )
    lines = [
        f"# Train pipelines {where} ({env['date']}, "
        f"torch {env['torch']}, torchrec {env['torchrec']}; {' '.join(c['overrides'])}, "
        f"{c['steps']} steps{_rounds(c)})",
        "",
        f"Link: tbf at {r['link']['rate_mbit']:,.0f} Mbit/s with a "
        f"{r['link']['burst_bytes'] / 1024:,.0f} KB burst; a chunked transfer with idle "
        f"gaps ({c['probe_chunk_bytes'] / 1024:,.0f} KB chunks) achieves "
        f"{r['link']['chunked_rate_ratio']:.2f}x the rate.",
        "",
        f"The plain loop spends {share:.0%} of its step on the link (its step time here "
        f"minus over a {c['fast_rate']} link)."
        if share is not None
        else "",
        "",
    ]
    lines += _headline(r) + _row_lines(r["rows"], r["speedup_vs_sparse_dist"])
    if r.get("multi_hot"):
        m = r["multi_hot"]
        share = m["plain_comm_share"]
        spends = f"; the plain loop spends {share:.0%} of its step on the link" if share else ""
        lines += ["", f"Multi-hot bags (dataset.hotness={m['hotness']}){spends}:", ""]
        lines += _headline(m) + _row_lines(m["rows"], m["speedup_vs_sparse_dist"])
    rw = (r.get("plans") or {}).get("row_wise")
    if rw:
        share = rw["plain_comm_share"]
        spends = f"; the plain loop spends {share:.0%} of its step on the link" if share else ""
        lines += ["", f"Row-wise plan ({' '.join(rw['overrides'])}){spends}:", ""]
        lines += _headline(rw) + _row_lines(rw["rows"], rw["speedup_vs_sparse_dist"])
    if r.get("not_run"):
        lines += [
            "",
            "Not run: " + "; ".join(f"{p} ({why})" for p, why in r["not_run"].items()) + ".",
        ]
    if r.get("burst_sensitivity"):
        names = [p for p in c["sensitivity_pipelines"] if p != "sparse_dist"]
        lines += [
            "",
            "Sensitivity to tbf's burst (the same runs at each burst):",
            "",
            "| burst | chunked transfer / rate | "
            + " | ".join(f"{p} vs sparse_dist" for p in names)
            + " |",
            "|---|---|" + "---|" * len(names),
        ]
        for b, x in r["burst_sensitivity"].items():
            speeds = " | ".join(f"{x['speedup_vs_sparse_dist'][p]:.2f}x" for p in names)
            lines.append(f"| {int(b) / 1024:,.0f} KB | {x['chunked_rate_ratio']:.2f}x | {speeds} |")
    lines += [
        "",
        "Per micro-batch of rank 0's batches of the same data: distinct (feature, id), "
        "and the embedding bytes they take, pooled (one vector per sample and feature) "
        "or as unique rows (dedup), with and without key-centric clustering:",
        "",
        "| N | distinct ids | clustered | pooled bytes | unique-row bytes | clustered |",
        "|---|---|---|---|---|---|",
    ]
    for x in r["clustering"]:
        lines.append(
            f"| {x['micro_batches']} | {x['distinct_ids']:,.0f} | "
            f"{x['distinct_ids_clustered']:,.0f} | {x['pooled_bytes'] / 1e6:,.2f} MB | "
            f"{x['unique_row_bytes'] / 1e6:,.2f} MB | "
            f"{x['unique_row_bytes_clustered'] / 1e6:,.2f} MB |"
        )
    return "\n".join(lines)


register_configs()  # the cluster group's schema
ConfigStore.instance().store(name="base_bench_pipeline", node=PipelineBenchConfig)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="bench_pipeline")
@benchmark_command
def main(cfg: DictConfig) -> None:
    typed: PipelineBenchConfig = start(cfg)
    typed.results_dir = typed.results_dir or results_dir_for("pipeline", typed.cluster)
    result = run(typed)
    finish(
        result,
        table(result),
        "pipeline",
        typed,
        json_name="summary",
        picture=(plots.pipelines, "pipelines.png"),
    )


if __name__ == "__main__":
    from recsys.launch import serve_forks_from_here

    serve_forks_from_here()  # its ranks start from the stack this process imported
    main()
