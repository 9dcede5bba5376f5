"""`python -m benchmarks.calibrate`: measure this machine, fit the cost model's constants for
local CPU ranks, then check predicted against measured step times.

Measured here, each fitted as time = fixed + amount / rate by least squares:
- embedding lookup + fused row-wise Adagrad update (FBGEMM's CPU TBE), forward bytes/s and
  the backward-to-forward ratio;
- dense MLP forward + backward, FLOP/s;
- in-memory synthetic batch assembly, s per sample;
- gloo all-to-all and all-reduce latency and bandwidth between 2 ranks on loopback and, as
  root, across a veth pair between two network namespaces rate-limited by tbf (`link_rate`);
- the per-step overhead: small training runs, measured minus the other terms; and the nested
  pipeline's per-micro-batch fixed work the same way, from runs at two micro-batch counts.
Writes `sharding/calibration/local_cpu.json` (the cost model's constants) and, with the
validation, `summary.json` + `calibrate.md` under benchmarks/results/calibrate/ and the
Hydra run dir. `summary.json` has `validation` (each `setting`, `predicted_ms`,
`measured_ms`) and `median_abs_error` (a fraction).
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import math
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import hydra
import numpy as np
import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from benchmarks import netns
from benchmarks.comm_probe import probe
from benchmarks.common import benchmark_command, environment, finish, start
from recsys import CONF_DIR
from recsys.host_memory import retain_freed_memory
from recsys.launch import raise_on_failure, spawn_ranks
from sharding.calibration import (
    OVERHEAD_FIELDS,
    RATE_FIELDS,
    SPLIT_WORK_FIELDS,
    Calibration,
    at_speed,
    load_calibration,
    save_calibration,
    without_split_work,
)
from sharding.types import DeviceCost, LinkCost, NetworkCost

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Setting:
    name: str
    overrides: list[str]
    link: str = "loopback"  # or veth, or emulated (the cluster its overrides name)


@dataclass
class GeneratedSettings:
    """Validation settings drawn at run time, the score the model is judged by: emulated
    layouts nobody tuned for (node counts, shares, links) with models, batches, planners and
    pipelines drawn alike (`generated_settings`). The fixed `settings` are the development
    set: changes to the model's form are justified there, judged here."""

    seeds: list[int] = field(default_factory=list)  # [] : none
    per_seed: int = 4
    max_cores: float = 1.8  # the shares of a layout add up to at most this many cores


@dataclass
class CalibrateConfig:
    link_rate: str = "1gbit"
    comm_sizes: list[int] = field(
        default_factory=lambda: [16_384, 131_072, 1_048_576, 4_194_304, 8_388_608]
    )
    train_steps: int = 80
    # and at least this long in timed steps: a run of a few seconds or less wanders from run
    # to run, so a run shorter than this is trained again, long enough (`_train`)
    timed_s: float = 6.0
    # runs of one model at four batch sizes: fixed and per-sample overhead. The residual is
    # not linear in the batch below ~512 samples a rank (a step's floor), so the line is
    # fitted over the range the validation and the benchmarks train at (and past it: no
    # validation setting lies beyond the largest run), not below it
    calibration_runs: list[int] = field(default_factory=lambda: [512, 1536, 3072, 6144])
    # each batch trained this many times (all batches, then all again), its median residual
    # fitted by Theil-Sen (`fit_line_robust`): one run of three at 3072 that came 15% fast
    # on a busy host hid a per-sample slope of ~5 us, which priced batch 4096 25% low
    calibration_repeats: int = 2
    # the cores' speed meter: before each validation setting the calibration run at this
    # batch is trained again, and the setting is also predicted with the constants at the
    # speed it finds (`cores_at_speed`): this machine's cores drift by minutes as well as
    # by days. 0, or a batch not among calibration_runs: no meter
    meter_batch: int = 1536
    # each validation setting trained this many times (all settings, then all again) and
    # its median compared: on a busy host one setting's step moved by a third within half
    # an hour (docs/clusters.md), more than any one run can be held to
    validation_repeats: int = 2
    # the nested pipeline's fixed work per micro-batch: N = 1 and 8 at one batch size
    micro_batch_runs: list[int] = field(default_factory=lambda: [1, 8])
    micro_batch_batch: int = 1024
    # ... and on each emulated cluster, each rank's CPU per micro-batch (its own cgroup's
    # figure, not the loopback one-core fit's), the mean over batches no validation
    # setting trains at
    emulated_micro_batch_batches: list[int] = field(default_factory=lambda: [1280, 2560])
    settings: list[Setting] = field(
        default_factory=lambda: [
            Setting("dlrm_small b1024 loopback plain", ["trainer.batch_size=1024"]),
            Setting("dlrm_small b4096 loopback plain", ["trainer.batch_size=4096"]),
            Setting(
                "dcnv2_small b2048 loopback sparse_dist",
                ["model=dcnv2_small", "pipeline=sparse_dist", "trainer.batch_size=2048"],
            ),
            Setting(
                "dlrm dim64 b2048 loopback plain",
                [
                    "model.embedding_dim=64",
                    "model.dense_arch_layer_sizes=[64,64]",
                    "trainer.batch_size=2048",
                ],
            ),
            Setting("dlrm_small b2048 veth plain", ["trainer.batch_size=2048"], "veth"),
            Setting(
                "dlrm dim64 b4096 veth plain",
                [
                    "model.embedding_dim=64",
                    "model.dense_arch_layer_sizes=[64,64]",
                    "trainer.batch_size=4096",
                ],
                "veth",
            ),
            Setting(
                "dlrm_small b1024 emu_mixed4 plain",
                ["cluster=emu_mixed4", "trainer.batch_size=1024"],
                "emulated",
            ),
            Setting(
                "dcnv2_small b1024 emu_mixed4 sparse_dist",
                [
                    "cluster=emu_mixed4",
                    "model=dcnv2_small",
                    "pipeline=sparse_dist",
                    "trainer.batch_size=1024",
                ],
                "emulated",
            ),
            Setting(
                "dlrm_small b2048 emu_mixed3 plain",
                ["cluster=emu_mixed3", "trainer.batch_size=2048"],
                "emulated",
            ),
            # hybrid's plans there: split tables, hot rows, a speed-aware batch split
            Setting(
                "dlrm_small b2048 emu_mixed4 plain hybrid",
                ["cluster=emu_mixed4", "trainer.batch_size=2048", "planner=hybrid"],
                "emulated",
            ),
            Setting(
                "dlrm_small b2048 emu_mixed3 plain hybrid",
                ["cluster=emu_mixed3", "trainer.batch_size=2048", "planner=hybrid"],
                "emulated",
            ),
            # the nested pipeline's schedule, across a veth link and on both mixed clusters
            Setting(
                "dlrm_small b2048 veth nested4",
                ["trainer.batch_size=2048", "pipeline=nested"],
                "veth",
            ),
            Setting(
                "dlrm_small b1024 emu_mixed4 nested4",
                ["cluster=emu_mixed4", "trainer.batch_size=1024", "pipeline=nested"],
                "emulated",
            ),
            Setting(
                "dlrm_small b2048 emu_mixed3 nested4",
                ["cluster=emu_mixed3", "trainer.batch_size=2048", "pipeline=nested"],
                "emulated",
            ),
        ]
    )
    # emulated clusters (root): each share's device constants, measured in its cgroup, and
    # the links between each cluster's ranks; settings with link "emulated" validate them
    emulated: list[str] = field(default_factory=lambda: ["emu_mixed4", "emu_mixed3", "emu_2node"])
    # settings generated from seeds, each on its own emulated layout, measured like the
    # presets (their constants kept in the run directory only) and reported apart
    generated: GeneratedSettings = field(default_factory=GeneratedSettings)
    share_window_s: float = 0.5  # each timing sample spans 5 CFS periods (see _median_time)
    # all: measure everything; emulated: keep the saved one-core constants and links,
    # measure only the emulated clusters (a new preset's shares) and validate everything
    measure: str = "all"
    # a calibrate run's directory: its constants (its generated layouts' included) taken as
    # they are, nothing measured again; only the validation runs (a run that stopped there)
    measured_in: str = ""
    # per rank: two hybrid runs each (pooled / sequence cold parts) for split tables' work
    split_batches: list[int] = field(default_factory=lambda: [512, 2048])
    # also write the published results and sharding/calibration/local_cpu.json, the
    # constants the planner reads (without it they land in the run directory only)
    save: bool = False
    results_dir: str = str(REPO / "benchmarks" / "results" / "calibrate")


def fit_line(x: list[float], y: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x; returns (a clipped at 0, b)."""
    b, a = np.polyfit(np.asarray(x, float), np.asarray(y, float), 1)
    return max(0.0, float(a)), float(b)


def fit_nonneg(columns: list[list[float]], y: list[float]) -> list[float]:
    """Least squares y = sum_k c_k x_k with every c_k >= 0 (a column of ones: an intercept):
    the best fit over each subset of the columns whose unconstrained fit is non-negative
    (the exact non-negative least squares for a few columns). A slope fitted negative is
    not kept beside the intercept it bent; the rest is fitted again without it."""
    x, target = np.asarray(columns, float).T, np.asarray(y, float)
    best, best_sse = [0.0] * len(columns), float(target @ target)
    for k in range(1, len(columns) + 1):
        for keep in itertools.combinations(range(len(columns)), k):
            c = np.linalg.lstsq(x[:, keep], target, rcond=None)[0]
            sse = float(np.sum((x[:, keep] @ c - target) ** 2))
            if (c >= 0).all() and sse < best_sse - 1e-18:
                best, best_sse = [0.0] * len(columns), sse
                for i, v in zip(keep, c, strict=True):
                    best[i] = float(v)
    return best


def fit_line_robust(x: list[float], y: list[float]) -> tuple[float, float]:
    """Theil-Sen y = a + b x: b the median of the slopes between every two points at
    different x, a the median of y - b x (clipped at 0). One point off the line by any
    amount moves it less than least squares would: a busy host's odd run."""
    pairs = [
        (y[j] - y[i]) / (x[j] - x[i])
        for i in range(len(x))
        for j in range(i + 1, len(x))
        if x[j] != x[i]
    ]
    if not pairs:
        raise ValueError(f"a line needs points at two different x at least, got x={x}")
    b = float(statistics.median(pairs))
    a = float(statistics.median(yi - b * xi for xi, yi in zip(x, y, strict=True)))
    return max(0.0, a), b


def _median_time(fn, repeats: int = 15, window_s: float = 0.0) -> float:
    """Median seconds per call of `repeats` samples, each timing enough calls to last
    `window_s`: under a CFS quota a sample must span several periods, or the median sees
    only the unthrottled runs (a core's speed, not the share's)."""
    fn()
    start = time.perf_counter()
    fn()
    calls = max(1, math.ceil(window_s / max(time.perf_counter() - start, 1e-6)))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def measure_embedding(repeats: int = 15, window_s: float = 0.0) -> dict:
    """FBGEMM CPU TBE with fused EXACT_ROWWISE_ADAGRAD, one thread, power-law ids."""
    from benchmarks.tbe_cpu import tbe_steps
    from recsys.data.planted import power_law_ranks

    rng = np.random.default_rng(0)
    points = []
    for tables, rows, dim, batch in [
        (8, 20000, 16, 1024),
        (8, 20000, 16, 4096),
        (26, 20000, 16, 2048),
        (8, 20000, 64, 2048),
        (26, 20000, 64, 4096),
    ]:
        ids = torch.from_numpy(power_law_ranks(rng.random(tables * batch), rows, 1.1))
        fwd, fwd_bwd = tbe_steps(tables, rows, dim, ids)
        f, fb = _median_time(fwd, repeats, window_s), _median_time(fwd_bwd, repeats, window_s)
        points.append(
            {
                "tables": tables,
                "dim": dim,
                "batch": batch,
                "bytes": tables * batch * dim * 4,
                "fwd_s": f,
                "fwd_bwd_s": fb,
            }
        )
    return {"points": points, **fit_embedding(points)}


def fit_embedding(points: list[dict]) -> dict:
    """The forward's and the backward's (with the fused update) seconds per byte looked up,
    each a line of its own over the probe's shapes; their fixed parts (a kernel call's, per
    step) are left to the training runs' fixed overhead. The backward is fitted alone, not
    as a ratio of the forward per shape: the forward's fixed part weighs on small shapes,
    and a median of ratios then underprices the backward of every shape."""
    nbytes = [p["bytes"] for p in points]
    _, fwd = fit_line(nbytes, [p["fwd_s"] for p in points])
    _, bwd = fit_line(nbytes, [p["fwd_bwd_s"] - p["fwd_s"] for p in points])
    return {"emb_read_bytes_per_s": 1.0 / fwd, "emb_bwd_factor": bwd / fwd}


def measure_dense(repeats: int = 7, window_s: float = 0.0) -> dict:
    """Forward + backward of DLRM's own dense part (bottom MLP, dot interaction, top MLP) at
    several sizes; FLOPs = 6 x MLP parameters x batch + the interaction's."""
    from torchrec.models.dlrm import DenseArch, InteractionArch, OverArch

    from sharding.cost_model import dot_interaction_flops

    points = []
    features = 26
    for dim, batch, top in [
        (16, 1024, [64, 32, 1]),
        (16, 4096, [64, 32, 1]),
        (64, 2048, [64, 32, 1]),
        (32, 2048, [256, 128, 1]),
        (16, 2048, [512, 256, 1]),
        (64, 1024, [512, 256, 1]),
    ]:
        bottom = DenseArch(13, [64, dim])
        inter = InteractionArch(features)
        over = OverArch(dim + features * (features + 1) // 2, top)
        x, emb = torch.randn(batch, 13), torch.randn(batch, features, dim, requires_grad=True)

        def step(bottom=bottom, inter=inter, over=over, x=x, emb=emb) -> None:
            over(inter(bottom(x), emb)).sum().backward()

        params = sum(p.numel() for m in (bottom, over) for p in m.parameters())
        points.append(
            {
                "dim": dim,
                "batch": batch,
                "top": top,
                "mlp_flops": 6 * params * batch,
                "interaction_flops": batch * dot_interaction_flops(features + 1, dim),
                "s": _median_time(step, repeats, window_s),
            }
        )
    # t = fixed + mlp_flops / mlp_rate + interaction_flops / interaction_rate
    a = np.array([[1.0, p["mlp_flops"], p["interaction_flops"]] for p in points])
    (_, per_mlp, per_inter), *_ = np.linalg.lstsq(a, np.array([p["s"] for p in points]), rcond=None)
    return {
        "points": points,
        "dense_flops_per_s": 1.0 / per_mlp,
        "interaction_flops_per_s": 1.0 / per_inter,
    }


def measure_input(repeats: int = 15, window_s: float = 0.0) -> dict:
    from recsys.config import SyntheticConfig
    from recsys.data.synthetic import SyntheticCriteo

    points = []
    for batch in (256, 1024, 4096):
        src = SyntheticCriteo(
            SyntheticConfig(), [20000] * 26, [f"cat_{i}" for i in range(26)], 13, batch
        )
        counter = iter(range(10**9))
        t = _median_time(lambda s=src, c=counter: s.batch("train", next(c), 0), repeats, window_s)
        points.append({"batch": batch, "s": t})
    _, per_sample = fit_line([p["batch"] for p in points], [p["s"] for p in points])
    return {"points": points, "input_s_per_sample": per_sample}


def measure_compute(repeats: int | None = None, window_s: float = 0.0) -> dict:
    """Embedding, dense and input rates of one rank while the others run the same work, as
    in training: ranks on two cores share caches and memory bandwidth. In an emulated
    cluster's cgroups: a few samples of `window_s` each (see `_median_time`). With the
    host memory kept as a training rank keeps it (`trainer.retain_host_memory`)."""
    torch.set_num_threads(1)
    retain_freed_memory()
    root = logging.getLogger()
    root.setLevel(logging.WARNING)  # FBGEMM logs every TBE it makes at INFO
    r = {} if repeats is None else {"repeats": repeats}
    return {
        "embedding": measure_embedding(**r, window_s=window_s),
        "dense": measure_dense(**r, window_s=window_s),
        "input": measure_input(**r, window_s=window_s),
    }


def _fit_comm(raw: dict, world: int = 2, nodes: list[int] | None = None) -> dict:
    """all-to-all: t = latency + sent/bw, sent = size (W-1)/W; ring all-reduce:
    t = 2(W-1) latency + 2(W-1)/W size / bw; the all-to-all's CPU seconds on a rank against
    the bytes it sends and receives (2 sent), the link's CPU cost per byte (both).
    `nodes[r]`, rank r's node on a cluster of several: the all-to-all's bandwidth is the
    link's between nodes, per rank as the cost model prices it (`cost_model._Exchange`: a
    rank's share of its node's link), so `sent` counts the bytes the rank with most peers
    on other nodes sends across (size (W - its node's ranks)/W)."""
    sizes = raw["sizes_bytes"]
    if world == 1:  # one rank: nothing crosses; a collective costs its fixed time alone
        return {
            "alltoall": _no_exchange(raw["alltoall_s"], raw.get("alltoall_cpu_s")),
            "allreduce": _no_exchange(raw["allreduce_s"], None),
            "raw": raw,
        }
    sent = [s * (world - 1) / world for s in sizes]
    across = sent
    if nodes is not None and len(set(nodes)) > 1:
        most = max(world - nodes.count(n) for n in nodes)
        across = [s * most / world for s in sizes]
    lat, per_b = fit_line(across, raw["alltoall_s"])
    ar_fixed, ar_per_b = fit_line([2 * (world - 1) / world * s for s in sizes], raw["allreduce_s"])
    cpu = 0.0  # an older probe did not measure it
    if "alltoall_cpu_s" in raw:
        cpu = max(0.0, fit_line([2 * x for x in sent], raw["alltoall_cpu_s"])[1])
    return {
        "alltoall": {"latency_s": lat, "bytes_per_s": 1.0 / per_b, "cpu_s_per_byte": cpu},
        "allreduce": {
            "latency_s": ar_fixed / (2 * (world - 1)),
            "bytes_per_s": 1.0 / ar_per_b,
            "cpu_s_per_byte": cpu,
        },
        "raw": raw,
    }


# the bandwidth of a link nothing crosses (one rank): never used by a price, since no byte
# is sent; finite, so that it stays JSON
UNUSED_BYTES_PER_S = 1e15


def _no_exchange(wall_s: list[float], cpu_s: list[float] | None) -> dict:
    """A one-rank collective: its median time as the latency, no bandwidth to fit."""
    return {
        "latency_s": float(np.median(wall_s)),
        "bytes_per_s": UNUSED_BYTES_PER_S,
        "cpu_s_per_byte": 0.0,
    }


def measure_comm(cfg: CalibrateConfig, link: netns.VethLink | None) -> dict:
    if link is None:
        return _fit_comm(raise_on_failure(spawn_ranks(probe, 2, (cfg.comm_sizes,)), "probe")[0])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "probe.json"
        netns.run_pair(link, ["-m", "benchmarks.comm_probe", str(out), *map(str, cfg.comm_sizes)])
        return _fit_comm(json.loads(out.read_text()))


def _compose(overrides: list[str]) -> DictConfig:
    """The trainer's config (conf/config.yaml) with overrides. Inside this Hydra app the
    global Hydra instance already searches conf/, so compose needs no initialize."""
    return hydra.compose(config_name="config", overrides=overrides)


WARMUP_STEPS = 10  # untimed steps at the start of every calibration and validation run


def _train(
    overrides: list[str],
    cfg: CalibrateConfig,
    run_dir: Path,
    link: netns.VethLink | None,
    step_ms: float | None = None,
) -> dict:
    """Train `cfg.train_steps` steps in `run_dir`; if the timed ones lasted less than
    `cfg.timed_s`, train again there with enough of them, the first run (which measured the
    step) kept beside it as `<run_dir>_short`. With `step_ms` known, once, long enough."""
    if step_ms is not None:
        needed = WARMUP_STEPS + math.ceil(cfg.timed_s / (step_ms / 1000))
        return _train_steps(overrides, max(cfg.train_steps, needed), run_dir, link)
    short = run_dir.with_name(f"{run_dir.name}_short")
    summary = _train_steps(overrides, cfg.train_steps, short, link)
    needed = WARMUP_STEPS + math.ceil(cfg.timed_s / (measured_ms(summary) / 1000))
    if needed <= cfg.train_steps:
        short.rename(run_dir)
        return summary
    return _train_steps(overrides, needed, run_dir, link)


def _train_steps(
    overrides: list[str], steps: int, run_dir: Path, link: netns.VethLink | None
) -> dict:
    args = [
        f"trainer.max_steps={steps}",
        "trainer.progress_bar=false",
        f"trainer.warmup_steps={WARMUP_STEPS}",
        "trainer.threads_per_rank=1",
        "dataset.eval_batches=1",
        *overrides,
    ]
    if link is None:
        from recsys.app.train import train

        return train(_compose(args), run_dir)
    netns.run_pair(link, ["-m", "recsys.train", *args, f"hydra.run.dir={run_dir}"])
    return json.loads((run_dir / "summary.json").read_text())


def predict_ms(overrides: list[str], run_dir: Path, link_name: str, cal) -> float:
    """The cost model's step time for the run in `run_dir`, under its own plan: one of our
    planners' as its plan.json has it (split tables, hot rows and batch split included),
    TorchRec's from the layout its ranks trained."""
    from recsys.app.planning import load_plan, on_part, plan_inputs
    from recsys.app.predict import predict
    from recsys.app.train import to_typed
    from sharding.subsets import parse

    ours = run_dir / "plan.json"
    if ours.exists() and (raw := json.loads(ours.read_text()))["planner"] != "torchrec":
        cfg = to_typed(_compose(overrides))
        inputs = plan_inputs(cfg, None, link_name, cal)
        if (part := parse(raw["cluster"])) is not None:  # the plan left devices out
            cfg, inputs = on_part(cfg, inputs, part[1], cal)
        return load_plan(str(ours), inputs).est_step_ms
    layout = json.loads((run_dir / "plan_layout.json").read_text())
    summary = run_dir / "summary.json"  # a speed-aware plan's own batch split
    batch = json.loads(summary.read_text())["batch_per_rank"] if summary.exists() else None
    return predict(to_typed(_compose(overrides)), layout, link_name, cal, batch)["step_ms"]


def measure_split(cfg: CalibrateConfig, run_dir: Path, cal) -> dict:
    """Split tables' CPU work: a hybrid plan with split tables trained with its cold parts
    pooled and as sequences, on loopback, at each of `split_batches`, each run predicted
    without that work (the pooled run priced pooled). The pooled runs' residuals fit the
    work of any split table, per table and per lookup of a rank's own samples into one; the
    sequence runs' beyond the pooled run's at the same batch fit the sequence exchange's,
    fixed and per sequence lookup. Non-negative least squares (`fit_nonneg`); each count is
    the model's own (its prediction's change at 1 s per unit: the busiest rank's). The split
    is forced (`plan_with_splits`: planned across the slowest measured link with that work
    free), so the measurement does not depend on what the planner, told the previous
    constants, would choose on loopback."""
    from recsys.app.planning import has_split_tables, plan_inputs, plan_with_splits, run_context
    from recsys.app.train import rank_main, to_typed
    from recsys.launch import raise_on_failure, spawn_ranks
    from sharding.plan_eval import evaluate

    link = min(cal.links, key=lambda k: cal.links[k].alltoall.bytes_per_s)
    free = without_split_work(cal)

    def config(batch: int, sequence: bool):
        return to_typed(
            _compose(
                [
                    "planner=hybrid",
                    f"planner.cold_only_exchange={sequence}",
                    f"trainer.batch_size={batch}",
                    f"trainer.max_steps={cfg.train_steps}",
                    "trainer.progress_bar=false",
                    f"trainer.warmup_steps={WARMUP_STEPS}",
                    "trainer.threads_per_rank=1",
                    "dataset.eval_batches=1",
                ]
            )
        )

    def predicted_ms(plan, typed, **unit: float) -> float:
        at = replace(free, device=replace(free.device, **unit))
        return evaluate(copy.deepcopy(plan), plan_inputs(typed, None, "loopback", at)).est_step_ms

    def run(batch: int, sequence: bool, plan) -> dict:
        typed = config(batch, sequence)
        plan = plan if sequence else pooled_exchange(plan)
        d = run_dir / "split_runs" / f"b{batch}_{'sequence' if sequence else 'pooled'}"
        d.mkdir(parents=True, exist_ok=True)
        job = spawn_ranks(rank_main, 2, args=(run_context(typed, plan), str(d)), timeout_s=900)
        summary = raise_on_failure(job, f"split-table calibration (batch {batch})")[0]
        base = predicted_ms(plan, typed)
        counts = {
            f: (predicted_ms(plan, typed, **{f: 1.0}) - base) / 1000
            for f in ("split_s_per_table", "split_s_per_lookup", "sequence_s_per_lookup")
        }
        return {
            "batch": batch,
            "sequence": sequence,
            "measured_ms": measured_ms(summary),
            "predicted_ms": base,
            "tables": counts["split_s_per_table"],
            "lookups": counts["split_s_per_lookup"],
            "sequence_lookups": counts["sequence_s_per_lookup"],
        }

    runs: list[dict] = []
    for batch in cfg.split_batches:
        plan = plan_with_splits(config(batch, True), cal, link)
        if not has_split_tables(plan):
            raise RuntimeError(
                f"split-table calibration: the hybrid plan splits no table at batch {batch} "
                f"even across {link} with their work free; run as root (the veth link is "
                f"measured then) or use larger split_batches"
            )
        runs += [run(batch, True, plan), run(batch, False, plan)]  # the same plan
    seq, pooled = runs[0::2], runs[1::2]
    residual_s = [(r["measured_ms"] - r["predicted_ms"]) / 1000 for r in pooled]
    per_table, per_lookup = fit_nonneg(
        [[r["tables"] for r in pooled], [r["lookups"] for r in pooled]], residual_s
    )
    extra_s = [
        (s["measured_ms"] - s["predicted_ms"] - p["measured_ms"] + p["predicted_ms"]) / 1000
        for s, p in zip(seq, pooled, strict=True)
    ]
    fixed, per_seq = fit_nonneg([[1.0] * len(seq), [r["sequence_lookups"] for r in seq]], extra_s)
    return {
        "runs": runs,
        "link": link,
        "split_s_per_table": per_table,
        "split_s_per_lookup": per_lookup,
        "sequence_s_fixed": fixed,
        "sequence_s_per_lookup": per_seq,
    }


def pooled_exchange(plan):
    """`plan` with every cold part's exchange pooled (what `planner.cold_only_exchange=false`
    trains), to price the run that trains it so."""
    out = copy.deepcopy(plan)
    for t in out.tables:
        t.shards = [replace(s, sparse_exchange=False) for s in t.shards]
    return out


def _device_cost(m: dict) -> DeviceCost:
    """The cost model's device constants from `measure_compute`'s rates (no overheads)."""
    emb, dense, inp = m["embedding"], m["dense"], m["input"]
    return DeviceCost(
        emb_read_bytes_per_s=emb["emb_read_bytes_per_s"],
        host_read_bytes_per_s=emb["emb_read_bytes_per_s"],  # host memory is the memory
        emb_bwd_factor=emb["emb_bwd_factor"],
        dense_flops_per_s=dense["dense_flops_per_s"],
        interaction_flops_per_s=dense["interaction_flops_per_s"],
        step_overhead_s=0.0,
        input_s_per_sample=inp["input_s_per_sample"],
    )


def _at_share(core: DeviceCost, measured: list[DeviceCost]) -> tuple[DeviceCost, float]:
    """One share's constants: the median of its ranks' measured rates; the overheads (per
    step, per sample, sequence), which only training runs measure, are the one-core fit's
    divided by the share's measured speed relative to one core (median of its rate ratios,
    returned too, and kept as `core_speed`: the network's CPU work divides by it)."""

    def med(name: str) -> float:
        return float(statistics.median(getattr(d, name) for d in measured))

    rates = ("emb_read_bytes_per_s", "dense_flops_per_s", "interaction_flops_per_s")
    ratios = [med(n) / getattr(core, n) for n in rates]
    ratio = float(statistics.median([*ratios, core.input_s_per_sample / med("input_s_per_sample")]))
    measured_here = (*RATE_FIELDS, "emb_bwd_factor", "input_s_per_sample")
    return replace(at_speed(core, ratio), **{k: med(k) for k in measured_here}), ratio


# what generated settings draw from: CPU-trainable models and their embedding widths
GENERATED_MODELS = [("dlrm_small", 16), ("dlrm_small", 32), ("dcnv2_small", 16), ("dlrm_small", 64)]
GENERATED_LINKS_GBIT_S = [0.2, 0.5, 1.0, 2.0]


def generated_settings(seed: int, count: int, max_cores: float = 1.8) -> list[Setting]:
    """`count` validation settings drawn from `seed`, each on its own emulated layout
    (`gen<seed>_<i>`): 1 to 3 nodes of 1 or 2 ranks (at most 4), each rank at a share of a
    core in [0.2, 0.8] (scaled down to `max_cores` in all), nodes joined at one of
    `GENERATED_LINKS_GBIT_S`; a model and width of `GENERATED_MODELS`, a batch of 1,024 or
    2,048 per rank, TorchRec's planner or hybrid, the plain loop, SparseDist or nested.
    The same seed gives the same settings."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        per_node = [rng.choice([1, 2]) for _ in range(rng.choice([1, 2, 2, 3]))]
        while sum(per_node) > 4:
            per_node.pop()
        shares = [[rng.uniform(0.2, 0.8) for _ in range(n)] for n in per_node]
        scale = min(1.0, max_cores / sum(map(sum, shares)))
        nodes = ",".join(
            "{count:1,host_memory_gib:4,host_to_device_gbyte_s:10,devices:["
            + ",".join(f"{{kind:cpu,count:1,hbm_gib:0.5,share:{x * scale:.2f}}}" for x in node)
            + "]}"
            for node in shares
        )
        model, dim = rng.choice(GENERATED_MODELS)
        link = rng.choice(GENERATED_LINKS_GBIT_S)
        batch = rng.choice([1024, 2048])
        planner = rng.choice(["torchrec", "hybrid"])
        pipeline = rng.choice(["plain", "sparse_dist", "nested"])
        name = f"gen{seed}_{i}"
        overrides = [
            "cluster=emu_mixed4",
            f"cluster.name={name}",
            f"cluster.nodes=[{nodes}]",
            f"cluster.network.inter_node_gbit_s={link}",
            f"model={model}",
            f"model.embedding_dim={dim}",
            f"model.dense_arch_layer_sizes=[64,{dim}]",
            f"trainer.batch_size={batch}",
            f"planner={planner}",
            f"pipeline={pipeline}",
        ]
        layout = "+".join(str(n) for n in per_node)
        what = f"{name} {layout} ranks {link:g}Gbit {model} dim{dim} b{batch} {planner} {pipeline}"
        out.append(Setting(what, overrides, "emulated"))
    return out


def _cluster_of(setting: Setting) -> list[str]:
    """A generated setting's cluster overrides (those that compose its layout)."""
    return [o for o in setting.overrides if o.startswith("cluster")]


def measure_emulated(
    cfg: CalibrateConfig,
    base: Calibration,
    run_dir: Path,
    clusters: dict[str, list[str]] | None = None,
) -> dict:
    """Per emulated cluster: every rank's compute rates in its own cgroup, all ranks at once
    as in training (each share's constants that cluster's own, `share_key`), gloo between
    all its ranks across its nodes (fitted as one link), and the nested pipeline's work per
    micro-batch on each rank (`measure_micro_batch_cpu`), trained under `base` with the
    cluster's shares and link just measured (`<cluster>_shares.json` in `run_dir`: a layout
    no calibration has seen plans there)."""
    from recsys import emulation
    from recsys.app.train import to_typed
    from recsys.config import cluster_overrides
    from sharding.calibration import share_key

    core = base.device
    shares, ratios, links, raw = {}, {}, {}, {}
    if clusters is None:
        clusters = {name: cluster_overrides(name) for name in cfg.emulated}
    for name, overrides in clusters.items():
        spec = to_typed(_compose(overrides)).cluster
        print(f"measuring {name}: each share in its cgroup, gloo across its nodes ...", flush=True)
        with emulation.emulated(spec) as emu:
            job = emulation.run_ranks(emu, measure_compute, (3, cfg.share_window_s), 1800)
            per_rank = raise_on_failure(job, f"compute probe on {name}")
            comm = emulation.run_ranks(emu, probe, (cfg.comm_sizes,), 900)
            links[name] = _fit_comm(
                raise_on_failure(comm, f"gloo probe on {name}")[0],
                len(emu.ranks),
                [r.node for r in emu.ranks],
            )
        at: dict[str, list[int]] = {}  # each share's ranks (`share_key`)
        for i, r in enumerate(emu.ranks):
            at.setdefault(share_key(r.share, name), []).append(i)
        for key, ranks in at.items():
            shares[key], ratios[key] = _at_share(core, [_device_cost(per_rank[i]) for i in ranks])
        ahead = copy.deepcopy(base)  # what its nested runs plan with
        ahead.shares.update({k: shares[k] for k in at})
        ahead.links[name] = _network_cost(links[name])
        save_calibration(ahead, run_dir / f"{name}_shares.json")
        shares_file = run_dir / f"{name}_shares.json"
        micro = measure_micro_batch_cpu(cfg, name, overrides, run_dir, shares_file)
        raw[name] = {
            "shares": [r.share for r in emu.ranks],
            "compute": per_rank,
            "micro_batch": micro,
        }
        if not micro["runs"]:
            continue
        for key, ranks in at.items():
            # a rank at its quota runs its CPU work at the share's rate; the cluster's own
            # figure replaces the one-core fit's at the share's speed
            cpu = statistics.median(micro["cpu_s_by_rank"][i] for i in ranks)
            share = min(1.0, emu.ranks[ranks[0]].share)
            shares[key] = replace(shares[key], micro_batch_overhead_s=cpu / share)
    return {"shares": shares, "speed_vs_one_core": ratios, "links": links, "raw": raw}


def _network_cost(fitted: dict) -> NetworkCost:
    """`_fit_comm`'s link as the cost model's."""
    return NetworkCost(LinkCost(**fitted["alltoall"]), LinkCost(**fitted["allreduce"]))


def measure_micro_batch_cpu(
    cfg: CalibrateConfig, cluster: str, overrides: list[str], run_dir: Path, calibration: Path
) -> dict:
    """The nested pipeline on an emulated cluster at the fewest and the most micro-batches of
    `micro_batch_runs`, at each of `emulated_micro_batch_batches`: each rank's CPU per step
    (its cgroup's, `cpu_ms_per_step_by_rank`), its difference over the micro-batches added,
    the mean over the batches (`cpu_s_by_rank`; one batch can mislead: on `emu_mixed4` the
    quarter-core ranks paid 2.7 ms a micro-batch at 1536 and 3.6-3.9 at 1024, 1280 and
    2048). Measured there, not scaled from the loopback fit: a rank at a share of a core
    pays more per micro-batch (smaller exchanges to more peers across the shaped link, each
    chunk's bookkeeping at its quota) than one core on loopback, and the step of a
    quota-bound rank is its CPU."""
    runs, per_batch = [], []
    for batch in cfg.emulated_micro_batch_batches:
        base = [
            *overrides,  # the cluster `cluster`: a preset, a part of one, or generated
            f"trainer.batch_size={batch}",
            f"planner.calibration={calibration}",
        ]
        trained = _nested_runs(cfg, base, run_dir, f"{cluster}_b{batch}_")
        at = [
            {
                "batch": batch,
                "micro_batches": n,
                "measured_ms": measured_ms(summary),
                "cpu_ms_per_step_by_rank": summary["cpu_ms_per_step_by_rank"],
            }
            for n, _, _, summary in trained
        ]
        runs += at
        if len(at) < 2 or at[-1]["micro_batches"] == at[0]["micro_batches"]:
            continue
        first, last = at[0], at[-1]
        pairs = zip(first["cpu_ms_per_step_by_rank"], last["cpu_ms_per_step_by_rank"], strict=True)
        per_batch.append([_per_micro_batch_s(first, last, a, b) for a, b in pairs])
    if not per_batch:
        return {"runs": [], "cpu_s_by_rank": []}
    mean = [statistics.fmean(x) for x in zip(*per_batch, strict=True)]
    return {"runs": runs, "cpu_s_by_rank": mean}


def _nested_runs(
    cfg: CalibrateConfig, base: list[str], run_dir: Path, prefix: str = ""
) -> list[tuple[int, list[str], Path, dict]]:
    """The nested pipeline trained with `base` overrides at each of `micro_batch_runs`, in
    `run_dir`/micro_batch_runs/<prefix>n<N>: (N, its overrides, its directory, its summary)."""
    out = []
    for n in cfg.micro_batch_runs:
        overrides = [*base, "pipeline=nested", f"pipeline.micro_batches={n}"]
        d = run_dir / "micro_batch_runs" / f"{prefix}n{n}"
        out.append((n, overrides, d, _train(overrides, cfg, d, None)))
    return out


def _per_micro_batch_s(first: dict, last: dict, first_ms: float, last_ms: float) -> float:
    """What each micro-batch past the first adds, in seconds, from a figure at the fewest
    (`first`) and the most (`last`) micro-batches; 0 where it fell or N did not change."""
    added = last["micro_batches"] - first["micro_batches"]
    return max(0.0, (last_ms - first_ms) / added / 1000) if added else 0.0


def measured_ms(summary: dict) -> float:
    return 1000 * sum(summary["batch_per_rank"]) / summary["samples_per_s"]


def measure_core(cfg: CalibrateConfig, run_dir: Path, link: netns.VethLink | None):
    """The one-core constants and the loopback / veth links (`link`: None without root)."""
    from sharding.calibration import load_calibration

    print("measuring embedding, dense and input throughput (2 ranks at once) ...", flush=True)
    both = raise_on_failure(spawn_ranks(measure_compute, 2, timeout_s=900), "compute probe")
    print("measuring gloo on loopback ...", flush=True)
    links = {"loopback": measure_comm(cfg, None)}
    if link:
        print(f"measuring gloo across a {cfg.link_rate} veth link ...", flush=True)
        links[f"veth_{cfg.link_rate}"] = measure_comm(cfg, link)
    nets = {k: _network_cost(v) for k, v in links.items()}
    cal = Calibration(device=_device_cost(both[0]), links=nets)
    save_calibration(cal, run_dir / "no_overhead.json")
    runs, fixed_s, per_sample_s = measure_overhead(
        cfg, run_dir, load_calibration(run_dir / "no_overhead.json")
    )
    cal.device = replace(
        cal.device, step_overhead_s=fixed_s, sample_overhead_s=max(0.0, per_sample_s)
    )
    print(
        "measuring the nested pipeline's per-micro-batch work (two training runs) ...", flush=True
    )
    micro = measure_micro_batch(cfg, run_dir, cal)
    cal.device = replace(cal.device, micro_batch_overhead_s=micro["per_micro_batch_s"])
    print("measuring split tables' CPU work (four hybrid runs) ...", flush=True)
    split = measure_split(cfg, run_dir, cal)
    cal.device = replace(cal.device, **{k: split[k] for k in SPLIT_WORK_FIELDS if k in split})
    emb, dense, inp = (both[0][k] for k in ("embedding", "dense", "input"))
    cal.measured = {
        "embedding": emb,
        "dense": dense,
        "input": inp,
        "links": {k: v["raw"] for k, v in links.items()},
        "overhead_runs": runs,
        "micro_batch": micro,
        "split": split,
    }
    return cal


def measure_overhead(cfg: CalibrateConfig, run_dir: Path, bare) -> tuple[list[dict], float, float]:
    """The per-step and per-sample framework overhead: the model trained on loopback at each
    of `calibration_runs`' batches, `calibration_repeats` times (every batch once, then all
    again), each batch's median step less its prediction under `bare` (the constants without
    overheads), a line through them by Theil-Sen. Returns (runs, fixed s, s per sample)."""
    repeats = max(1, cfg.calibration_repeats)
    print(
        f"measuring the per-step overhead ({len(cfg.calibration_runs)} batch sizes, "
        f"{repeats}x each) ...",
        flush=True,
    )
    trained: dict[int, list[float]] = {}
    predicted: dict[int, float] = {}
    for r in range(repeats):  # every batch once, then all again (as long as the first ran)
        for batch in cfg.calibration_runs:
            overrides = [f"trainer.batch_size={batch}"]
            d = run_dir / "calibration_runs" / (f"b{batch}" + (f"_run{r + 1}" if r else ""))
            step_ms = trained[batch][0] if r else None
            trained.setdefault(batch, []).append(
                measured_ms(_train(overrides, cfg, d, None, step_ms=step_ms))
            )
            if not r:  # one plan per batch: the repeats are priced alike
                predicted[batch] = predict_ms(overrides, d, "loopback", bare)
    runs = [
        {
            "batch": b,
            "measured_ms": float(statistics.median(trained[b])),
            "measured_runs_ms": trained[b],
            "predicted_without_overhead_ms": predicted[b],
        }
        for b in cfg.calibration_runs
    ]
    residual = [(r["measured_ms"] - r["predicted_without_overhead_ms"]) / 1000 for r in runs]
    fixed_s, per_sample_s = fit_line_robust(list(cfg.calibration_runs), residual)
    return runs, fixed_s, per_sample_s


def measure_micro_batch(cfg: CalibrateConfig, run_dir: Path, cal) -> dict:
    """The nested pipeline at the fewest and the most micro-batches of `micro_batch_runs`, on
    loopback: each run measured less its prediction without the per-micro-batch work, the
    difference over the micro-batches added (`DeviceCost.micro_batch_overhead_s`)."""
    trained = _nested_runs(cfg, [f"trainer.batch_size={cfg.micro_batch_batch}"], run_dir)
    runs = [
        {
            "micro_batches": n,
            "measured_ms": measured_ms(summary),
            "predicted_without_it_ms": predict_ms(overrides, d, "loopback", cal),
        }
        for n, overrides, d, summary in trained
    ]
    first, last = runs[0], runs[-1]
    residual = [r["measured_ms"] - r["predicted_without_it_ms"] for r in (first, last)]
    return {"runs": runs, "per_micro_batch_s": _per_micro_batch_s(first, last, *residual)}


def refreshed(cal, probe: dict):
    """`cal` with this machine's rates today: the one-core rates from `probe`
    (`measure_compute` on 2 ranks, about a minute), the overheads (which only training runs
    measure) by the dense rate's change, and every emulated share's constants scaled alike
    (a share is a fraction of the same core); the links and the backward factor as saved.
    The cores change speed from day to day; a prediction is checked against a measurement
    beside a fresh probe of the same cores."""
    fresh = _device_cost(probe)
    # rates, and the one time the probe measures (input per sample): today's over the saved
    ratio = {
        k: getattr(fresh, k) / getattr(cal.device, k)
        for k in (*RATE_FIELDS, "input_s_per_sample")
        if getattr(cal.device, k) and getattr(fresh, k)
    }
    # the framework's CPU work per step, sample and cold lookup: as the core's speed moved
    slower = 1 / ratio.get("dense_flops_per_s", 1.0)
    ratio |= dict.fromkeys(OVERHEAD_FIELDS, slower)

    def scaled(d):
        return replace(d, **{k: getattr(d, k) * r for k, r in ratio.items()})

    out = replace(
        cal, device=scaled(cal.device), shares={k: scaled(v) for k, v in cal.shares.items()}
    )
    out.measured = {**cal.measured, "refreshed": {"vs_saved": ratio, "environment": environment()}}
    return out


def refresh_calibration():
    """`refreshed(load_calibration(), <a new compute probe>)`: what `recalibrate=true` in
    `benchmarks.plan_train` and `benchmarks.pipeline` predicts with."""
    print("re-measuring the per-core rates (2 ranks at once, about a minute) ...", flush=True)
    probe = raise_on_failure(spawn_ranks(measure_compute, 2, timeout_s=900), "compute probe")
    return refreshed(load_calibration(), probe[0])


def validate(
    cfg: CalibrateConfig,
    cal,
    run_dir: Path,
    link: netns.VethLink | None,
    why_not: str | None,
    generated: list[Setting] | None = None,
) -> list[dict]:
    """Each setting trained for real `validation_repeats` times (every setting once, then
    all again: a host's slow half hour lands on all of them, not on one), its plan made with
    this run's constants (`run_dir`'s local_cpu.json: a cluster measured here but not saved
    has its shares there only), its step time predicted under that plan; the median of the
    runs against the median of the predictions, each run's step kept (`measured_runs_ms`)."""
    from recsys.app.train import to_typed

    meter = {r["batch"]: r["measured_ms"] for r in cal.measured.get("overhead_runs", [])}.get(
        cfg.meter_batch
    )
    settings = []
    drawn = {s.name for s in generated or []}
    for s in [*cfg.settings, *(generated or [])]:
        if s.link != "loopback" and why_not is not None:
            print(f"skipping '{s.name}': {why_not}", flush=True)
            continue
        link_name = {"veth": f"veth_{cfg.link_rate}", "loopback": "loopback"}.get(s.link)
        if s.link == "emulated":  # the cluster's own calibrated link
            link_name = to_typed(_compose(s.overrides)).cluster.name
        settings.append((s, link_name))
    runs: dict[str, list[dict]] = {}
    repeats = max(1, cfg.validation_repeats)
    for r in range(repeats):
        for s, link_name in settings:
            name = s.name.replace(" ", "_") + (f"_run{r + 1}" if repeats > 1 else "")
            run = {}
            if meter:
                print(f"the cores' speed meter (batch {cfg.meter_batch}) ...", flush=True)
                now = _train(
                    [f"trainer.batch_size={cfg.meter_batch}"],
                    cfg,
                    run_dir / "meter" / name,
                    None,
                    step_ms=meter,
                )
                run["cores_speed"] = meter / measured_ms(now)
            print(f"validating: {s.name} (run {r + 1} of {repeats}) ...", flush=True)
            d = run_dir / "validation" / name
            own = f"planner.calibration={run_dir / 'local_cpu.json'}"
            first = runs[s.name][0]["measured_ms"] if r else None  # long enough, once
            summary = _train(
                [*s.overrides, own], cfg, d, link if s.link == "veth" else None, step_ms=first
            )
            run |= {
                "predicted_ms": predict_ms(s.overrides, d, link_name, cal),
                "measured_ms": measured_ms(summary),
            }
            if meter:
                at = cores_at_speed(cal, run["cores_speed"])
                run["predicted_beside_ms"] = predict_ms(s.overrides, d, link_name, at)
            runs.setdefault(s.name, []).append(run)
    validation = []
    for s, link_name in settings:
        med = {k: float(statistics.median(x[k] for x in runs[s.name])) for k in runs[s.name][0]}
        pred, meas = med["predicted_ms"], med["measured_ms"]
        entry = {
            "setting": s.name,
            "generated": s.name in drawn,  # the score, apart from the development settings
            "overrides": s.overrides,
            "link": link_name,
            "predicted_ms": pred,
            "measured_ms": meas,
            "rel_error": (pred - meas) / meas,
            "measured_runs_ms": [x["measured_ms"] for x in runs[s.name]],
        }
        if meter:
            beside = med["predicted_beside_ms"]
            entry |= {
                "cores_speed": med["cores_speed"],
                "predicted_beside_ms": beside,
                "rel_error_beside": (beside - meas) / meas,
            }
        validation.append(entry)
    return validation


def _merge_emulated(cal: Calibration, emulated: dict) -> None:
    """`measure_emulated`'s clusters into `cal`; other clusters' stay."""
    cal.shares.update(emulated["shares"])
    cal.links.update({k: _network_cost(v) for k, v in emulated["links"].items()})
    cal.measured.setdefault("links", {}).update({k: v["raw"] for k, v in emulated["links"].items()})
    known = cal.measured.setdefault("emulated", {})
    known.setdefault("speed_vs_one_core", {}).update(emulated["speed_vs_one_core"])
    known.update(emulated["raw"])


def cores_at_speed(cal, speed: float):
    """`cal` on cores `speed` times as fast as when it was measured: every CPU rate times
    `speed` and every CPU time over it, on one core and on each emulated share alike (a
    share is a fraction of the same cores); the links as measured."""
    return replace(
        cal,
        device=at_speed(cal.device, speed),
        shares={k: at_speed(v, speed) for k, v in cal.shares.items()},
    )


def _measure(
    cfg: CalibrateConfig, run_dir: Path, link, why_not: str | None, generated: list[Setting]
) -> Calibration:
    """The constants `cfg` asks for: one core's (`measure=all`) or the saved ones, the
    emulated clusters' (saved with `save=true`), then the generated settings' layouts (kept
    in the run directory only)."""
    if cfg.measure == "all":
        cal = measure_core(cfg, run_dir, link)
    else:  # the saved one-core constants; only the emulated clusters measured anew
        cal = load_calibration()
    if cfg.emulated and why_not is None:
        _merge_emulated(cal, measure_emulated(cfg, cal, run_dir))
    elif cfg.emulated:
        print(f"skipping the emulated clusters {cfg.emulated}: {why_not}", flush=True)
    measured = cfg.measure == "all" or bool(cfg.emulated and why_not is None)
    if measured:
        cal.measured["environment"] = environment()
    if cfg.save and measured:  # only generated settings: the saved constants untouched
        save_calibration(cal)
    if generated and why_not is None:  # measured as a user measures a new layout
        layouts = {g.name.split()[0]: _cluster_of(g) for g in generated}
        _merge_emulated(cal, measure_emulated(cfg, cal, run_dir, layouts))
    elif generated:
        print(f"skipping the generated settings: {why_not}", flush=True)
    return cal


def run(cfg: CalibrateConfig, run_dir: Path) -> dict:
    if cfg.measure not in ("all", "emulated"):
        raise ValueError(f"measure must be all or emulated, got '{cfg.measure}'")
    torch.set_num_threads(1)
    why_not = netns.available()
    link_ctx = netns.veth_link(cfg.link_rate) if why_not is None else None
    generated = [
        g
        for seed in cfg.generated.seeds
        for g in generated_settings(seed, cfg.generated.per_seed, cfg.generated.max_cores)
    ]
    try:
        link = link_ctx.__enter__() if link_ctx else None
        if cfg.measured_in:  # that run's constants, its generated layouts' too: validate only
            cal = load_calibration(Path(cfg.measured_in) / "local_cpu.json")
            print(f"the constants of {cfg.measured_in}: nothing measured again", flush=True)
        else:
            cal = _measure(cfg, run_dir, link, why_not, generated)
        save_calibration(cal, run_dir / "local_cpu.json")  # with them: this run's only
        save_calibration(cal, run_dir / "local_cpu.json")  # with them: this run's only
        cal = load_calibration(run_dir / "local_cpu.json")
        validation = validate(cfg, cal, run_dir, link, why_not, generated)
    finally:
        if link_ctx:
            link_ctx.__exit__(None, None, None)
    drawn = [v for v in validation if v["generated"]]
    validation_dev = [v for v in validation if not v["generated"]]
    errors = [abs(v["rel_error"]) for v in validation_dev]
    worst = max(validation_dev, key=lambda v: abs(v["rel_error"]), default=None)
    worst_drawn = max(drawn, key=lambda v: abs(v["rel_error"]), default=None)
    beside = [v for v in validation_dev if "rel_error_beside" in v]
    worst_beside = max(beside, key=lambda v: abs(v["rel_error_beside"]), default=None)
    return {
        "constants": {
            "device": cal.device.__dict__,
            "links": {
                k: {"alltoall": v.alltoall.__dict__, "allreduce": v.allreduce.__dict__}
                for k, v in cal.links.items()
            },
            "shares": {k: v.__dict__ for k, v in cal.shares.items()},
            "speed_vs_one_core": (cal.measured.get("emulated") or {}).get("speed_vs_one_core", {}),
        },
        "validation": validation,
        # the development settings (fixed; the model's form was revised on them)
        "median_abs_error": statistics.median(errors) if errors else None,
        "worst_setting": worst and worst["setting"],
        # the settings drawn at run time from `generated.seeds`: the score
        "median_abs_error_generated": statistics.median(abs(v["rel_error"]) for v in drawn)
        if drawn
        else None,
        "worst_generated": worst_drawn
        and {"setting": worst_drawn["setting"], "rel_error": worst_drawn["rel_error"]},
        # the same predictions with the cores' speed measured beside each setting (the meter)
        "median_abs_error_beside": statistics.median(abs(v["rel_error_beside"]) for v in beside)
        if beside
        else None,
        "worst_setting_beside": worst_beside and worst_beside["setting"],
        "veth": why_not or f"measured ({cfg.link_rate})",
        "environment": environment(),
        "config": OmegaConf.to_container(OmegaConf.structured(cfg)),
    }


def table(r: dict) -> str:
    d = r["constants"]["device"]
    lines = [
        f"# Cost-model calibration and validation ({r['environment']['date']}, "
        f"{r['environment']['cpus']} CPUs, torch {r['environment']['torch']}, torchrec "
        f"{r['environment']['torchrec']}, fbgemm_gpu {r['environment']['fbgemm_gpu']})",
        "",
        "| constant (one CPU rank, one thread) | value |",
        "|---|---|",
        f"| embedding forward read | {d['emb_read_bytes_per_s'] / 1e9:.2f} GB/s |",
        f"| embedding backward + update / forward | {d['emb_bwd_factor']:.2f} |",
        f"| dense MLP | {d['dense_flops_per_s'] / 1e9:.1f} GFLOP/s |",
        f"| DLRM dot interaction | {d['interaction_flops_per_s'] / 1e9:.1f} GFLOP/s |",
        f"| batch assembly | {d['input_s_per_sample'] * 1e6:.2f} us/sample |",
        f"| per-step overhead | {d['step_overhead_s'] * 1e3:.2f} ms + "
        f"{d['sample_overhead_s'] * 1e6:.2f} us/sample |",
        f"| nested pipeline, per micro-batch past the first | "
        f"{d.get('micro_batch_overhead_s', 0.0) * 1e3:.2f} ms |",
        f"| split tables (either exchange) | "
        f"{d.get('split_s_per_table', 0.0) * 1e3:.2f} ms/table + "
        f"{d.get('split_s_per_lookup', 0.0) * 1e6:.3f} us/lookup |",
        f"| sequence exchange (split tables' cold parts), beyond that | "
        f"{d.get('sequence_s_fixed', 0.0) * 1e3:.2f} ms + "
        f"{d.get('sequence_s_per_lookup', 0.0) * 1e6:.3f} us/lookup |",
    ]
    for name, link in r["constants"]["links"].items():
        for op in ("alltoall", "allreduce"):
            c = link[op]
            cpu = c.get("cpu_s_per_byte", 0.0)  # the rank's CPU per byte sent or received
            cpu_text = f", CPU {cpu * 1e9:.2f} ns/B" if op == "alltoall" and cpu else ""
            lines.append(
                f"| {name} {op} | {c['latency_s'] * 1e6:.0f} us + "
                f"{c['bytes_per_s'] / 1e6:.0f} MB/s{cpu_text} |"
            )
    for key, ratio in r["constants"].get("speed_vs_one_core", {}).items():
        c, (cluster, _, share) = r["constants"]["shares"][key], key.rpartition("/")
        lines.append(
            f"| {cluster or 'emulated'} rank at share {share} (its cgroup) | "
            f"{ratio:.2f}x one core: "
            f"{c['emb_read_bytes_per_s'] / 1e9:.2f} GB/s embedding, "
            f"{c['dense_flops_per_s'] / 1e9:.1f} GFLOP/s dense, "
            f"{c.get('micro_batch_overhead_s', 0.0) * 1e3:.1f} ms a micro-batch "
            "(its CPU on the cluster at the quota) |"
        )
    metered = any("rel_error_beside" in v for v in r["validation"])
    repeated = any(len(v.get("measured_runs_ms", [])) > 1 for v in r["validation"])
    lines += [
        "",
        "| setting | predicted ms/step | measured ms/step | error |"
        + (" cores' speed beside | predicted at it | error |" if metered else "")
        + (" each run's ms/step |" if repeated else ""),
        "|---|---|---|---|" + ("---|---|---|" if metered else "") + ("---|" if repeated else ""),
    ]
    for v in r["validation"]:
        row = (
            f"| {v['setting']} | {v['predicted_ms']:.1f} | {v['measured_ms']:.1f} | "
            f"{v['rel_error']:+.0%} |"
        )
        if "rel_error_beside" in v:
            row += (
                f" {v['cores_speed']:.2f}x | {v['predicted_beside_ms']:.1f} | "
                f"{v['rel_error_beside']:+.0%} |"
            )
        if repeated:
            row += " " + " / ".join(f"{x:.1f}" for x in v.get("measured_runs_ms", [])) + " |"
        lines.append(row)
    if r["median_abs_error"] is not None:
        lines += [
            "",
            f"Median absolute relative error on the development settings: "
            f"{r['median_abs_error']:.1%}; worst: {r['worst_setting']}",
        ]
    if r.get("median_abs_error_generated") is not None:
        worst = r["worst_generated"]
        lines += [
            "",
            f"On the {sum(v.get('generated', False) for v in r['validation'])} settings "
            f"generated from seeds {r['config']['generated']['seeds']} (the score; goal: a "
            f"median of at most 10%, none worse than 25%): "
            f"{r['median_abs_error_generated']:.1%}; worst: {worst['setting']} "
            f"({worst['rel_error']:+.0%})",
        ]
    if r.get("median_abs_error_beside") is not None:
        lines += [
            "",
            f"With the cores' speed measured beside each setting (the calibration run at "
            f"batch {r['config']['meter_batch']} trained again just before it): "
            f"{r['median_abs_error_beside']:.1%}; worst: {r['worst_setting_beside']}",
        ]
    lines += ["", f"veth link: {r['veth']}"]
    return "\n".join(lines)


ConfigStore.instance().store(name="base_calibrate", node=CalibrateConfig)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="calibrate")
@benchmark_command
def main(cfg: DictConfig) -> None:
    typed: CalibrateConfig = start(cfg)
    result = run(typed, Path(HydraConfig.get().runtime.output_dir))
    finish(result, table(result), "calibrate", publishing(typed, result), json_name="summary")


def publishing(cfg: CalibrateConfig, result: dict) -> CalibrateConfig:
    """`cfg` for writing the results: with `save=true` and nothing validated (a user's own
    cluster measured alone, `settings=[]`) the constants are saved (`run`), but the published
    results, whose point is the validation, are kept."""
    if cfg.save and not result["validation"]:
        print(
            f"nothing was validated: the constants are saved, the published results in "
            f"{cfg.results_dir} are kept",
            flush=True,
        )
        return replace(cfg, save=False)
    return cfg


if __name__ == "__main__":
    from recsys.launch import serve_forks_from_here

    serve_forks_from_here()  # its ranks start from the stack this process imported
    main()
