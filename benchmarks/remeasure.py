"""Re-measure the published results (`benchmarks/results/`) that another stack measured.

    python -m benchmarks.remeasure            # run every stale result set, one at a time
    python -m benchmarks.remeasure --list     # only say which are stale and why
    python -m benchmarks.remeasure pipeline plan_train   # these (stale or not), in this order

A result set is stale when the torch, torchrec or fbgemm_gpu version in its JSON file's
`environment` block is not the installed one, or when the code it measured has changed since
(`benchmarks.fingerprint`). They run in the order below, calibration
first (the others' predictions use its constants), then the ones the README and docs quote
most, the planners' at-scale run last; each as its own process with the machine otherwise
idle (the timings are the point); a stopped run resumes where it stopped, since the sets
already re-measured are no longer stale. Each set's command is the one its
results were published with (`benchmarks/results/README.md`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import fingerprint

RESULTS = Path(__file__).resolve().parent / "results"
# the reduced pipeline sets: no burst sweep, no multi-hot rows, no second (row-wise) plan,
# one run of each pipeline on each link
_SHAPED = ["burst_sensitivity=[]", "multi_hot=null", "row_wise=null", "repeats=1"]
# the training benchmarks' overrides (quoted: each holds an `=`)
_SGD = ",".join(
    f"'{o}'"
    for o in [
        "trainer.batch_size=2048",
        "planner=round_robin",
        "trainer.dense_optimizer=sgd",
        "trainer.lr=0.1",
    ]
)

# (result set, its JSON file, the command's arguments after `python -m`); save=true
# publishes into benchmarks/results/<set> (results_dir= where the name is not the default)
PUBLISHED = [
    ("calibrate", "summary.json", ["benchmarks.calibrate"]),
    ("pipeline", "summary.json", ["benchmarks.pipeline"]),
    ("plan_train", "summary.json", ["benchmarks.plan_train"]),
    (
        "pipeline_200mbit",
        "summary.json",
        [
            "benchmarks.pipeline",
            "link_rate=200mbit",
            *_SHAPED,
            "pipelines=[plain,sparse_dist,semi_sync,nested2,nested4,nested8,nested4+dedup]",
        ],
    ),
    # both plans, the alternatives that tell the gain apart, hybrid kept on every device,
    # and TorchRec's planner on each part of the cluster (docs/planning.md)
    *(
        (
            f"plan_train_{cluster}",
            "summary.json",
            [
                "benchmarks.plan_train",
                f"cluster={cluster}",
                "planners=[torchrec,torchrec+hybrid_split,hybrid+equal_split,hybrid+all_devices,"
                "hybrid]",
                "parts=[torchrec]",
                "repeats=3",
            ],
        )
        for cluster in ("emu_mixed4", "emu_mixed3", "emu_mixed_even", "emu_mixed_tight")
    ),
    # emu_mixed3's one-rank plans against hybrid kept on every device, more rounds
    (
        "plan_train_emu_mixed3_parts",
        "summary.json",
        [
            "benchmarks.plan_train",
            "cluster=emu_mixed3",
            "planners=[hybrid,hybrid+all_devices]",
            "parts=[torchrec]",
            "repeats=5",
        ],
    ),
    # the cost model scored on settings drawn at run time, each layout measured as a user's
    (
        "calibrate_generated",
        "summary.json",
        [
            "benchmarks.calibrate",
            "measure=emulated",
            "emulated=[]",
            "settings=[]",
            "generated.seeds=[1,2]",
            "generated.per_seed=4",
        ],
    ),
    # hybrid's plan at several batch splits: does the split it picks train fastest?
    ("batch_split_emu_mixed3", "summary.json", ["benchmarks.batch_split", "cluster=emu_mixed3"]),
    ("batch_split_emu_mixed4", "summary.json", ["benchmarks.batch_split", "cluster=emu_mixed4"]),
    (
        "pipeline_emu_mixed4",
        "summary.json",
        [
            "benchmarks.pipeline",
            "cluster=emu_mixed4",
            *_SHAPED,
            "pipelines=[plain,base,sparse_dist,fused_sparse_dist,semi_sync,nested1,nested2,nested4,"
            "nested8,nested4+lookahead,nested4+cluster,nested4+dedup,nested8+dedup,"
            "nested4+dedup+cluster,nested4+dedup_fwd,nested8+dedup_fwd,nested4+lookahead+dedup_fwd]",
            f"overrides=[{_SGD}]",
        ],
    ),
    (
        "pipeline_emu_mixed3",
        "summary.json",
        [
            "benchmarks.pipeline",
            "cluster=emu_mixed3",
            *_SHAPED,
            "pipelines=[plain,sparse_dist,fused_sparse_dist,semi_sync,nested2,nested4,nested8,"
            "nested4+dedup,nested4+dedup_fwd,nested8+dedup_fwd]",
            f"overrides=[{_SGD}]",
        ],
    ),
    # after the sets its validation reads (DEPENDS)
    ("scale", "summary.json", ["benchmarks.scale", "precision=bf16"]),  # MLPerf's precision
    ("data", "data.json", ["benchmarks.data"]),
    ("speed_aware", "speed_aware.json", ["benchmarks.speed_aware", "repeats=3"]),
    ("order_noise", "order_noise.json", ["benchmarks.order_noise"]),
    (
        "order_noise_dedup",
        "order_noise.json",
        ["benchmarks.order_noise", "nested_overrides=['pipeline.dedup=true']"],
    ),
    (
        "order_noise_multi_hot",
        "order_noise.json",
        [
            "benchmarks.order_noise",
            f"overrides=[{_SGD},'dataset.hotness=mlperf']",
            "steps=60",
            "nested_overrides=['pipeline.dedup=true']",
        ],
    ),
    (
        "pipeline_emu_mixed4_ddp_buckets",
        "summary.json",
        [
            "benchmarks.pipeline",
            "cluster=emu_mixed4",
            *_SHAPED,
            "pipelines=[plain,sparse_dist,semi_sync,nested2,nested4,nested8,nested2+dedup,"
            "nested4+dedup,nested8+dedup]",
            f"overrides=[{_SGD},'trainer.dense_allreduce=ddp_buckets']",
        ],
    ),
    # the dense reduction every pipeline shares against TorchRec's DDP (2 ranks, loopback)
    ("dense_reduce", "dense_reduce.json", ["benchmarks.dense_reduce"]),
    (
        "scale_multihot",
        "summary.json",
        [
            "benchmarks.scale",
            "families=[homogeneous,mixed]",
            "workers=[8,64,128,512,1536]",
            "planners=[hybrid,torchrec,torchrec_twrw]",
            "torchrec_max_workers=128",
            "profile=benchmarks/results/scale/profile_mlperf_multihot.json",
            "validation=false",
        ],
    ),
    (
        "scale_multihot_bf16",
        "summary.json",  # the dense part at MLPerf's precision
        [
            "benchmarks.scale",
            "families=[homogeneous,mixed]",
            "workers=[8,64,128,512,1536]",
            "planners=[hybrid,torchrec,torchrec_twrw]",
            "torchrec_max_workers=128",
            "profile=benchmarks/results/scale/profile_mlperf_multihot.json",
            "validation=false",
            "precision=bf16",
        ],
    ),
    ("emulation_fidelity", "emulation_fidelity.json", ["benchmarks.emulation_fidelity"]),
    ("two_d", "summary.json", ["benchmarks.two_d"]),  # hybrid's plan vs synchronous 2D groups
    # ... and 2D groups trained: one replica per node of the emulated 2-node cluster
    (
        "plan_train_emu_2node",
        "summary.json",
        ["benchmarks.plan_train", "cluster=emu_2node", "planners=[hybrid,hybrid+2d1]"],
    ),
    ("movielens100k", "movielens.json", ["benchmarks.movielens"]),
    (
        "pipeline_movielens100k",
        "summary.json",
        [
            "benchmarks.pipeline",
            *_SHAPED,
            f"probe_chunk_bytes={2048 * 3 * 64 // 4}",  # nested4's share: 3 tables x 16 floats
            "pipelines=[plain,sparse_dist,nested4,nested4+cluster,nested4+dedup,"
            "nested4+dedup+cluster,nested8,nested8+cluster]",
            f"overrides=['dataset=movielens100k',{_SGD}]",
        ],
    ),
    ("planners", "summary.json", ["benchmarks.planners"]),  # about 1.8 h: the 400-cell grid
    # the grid's cells on mixed clusters joined at or below 25 Gbit/s alone (about 20 min)
    (
        "planners_slow_mixed",
        "summary.json",
        [
            "benchmarks.planners",
            "clusters=[hetero_3node]",
            "at_scale=false",
            "grid.only_slow_mixed=true",
            "grid.profile=benchmarks/results/planners/profile_mlperf_synthetic.json",
        ],
    ),
    # after it: its cut TorchRec searches, searched longer (about 25 min)
    ("grid_recheck", "summary.json", ["benchmarks.grid_recheck"]),
]

# <name>_<cluster> already
_DEFAULT_DIR = {
    "plan_train_emu_mixed4",
    "pipeline_emu_mixed4",
    "plan_train_emu_2node",
    "plan_train_emu_mixed3",
    "plan_train_emu_mixed_even",
    "plan_train_emu_mixed_tight",
    "pipeline_emu_mixed3",
    "batch_split_emu_mixed3",
    "batch_split_emu_mixed4",
}
# the sets a set's run reads, which PUBLISHED's order runs first (benchmarks.scale validates
# its simulator against the calibration's and the emulated pipeline's measured steps)
DEPENDS = {
    "scale": ("calibrate", "pipeline_emu_mixed4"),
    "scale_multihot": ("calibrate",),
    "scale_multihot_bf16": ("calibrate",),
    "two_d": ("calibrate",),
    "calibrate_generated": ("calibrate",),
}
# result sets that compare stacks, each run adding its own stack's rows: never stale
ACROSS_STACKS = {"tbe_cpu"}
# result sets a user's own steps made, more than one command each (benchmarks/results/
# README.md lists them): never re-run from here
# plan_train_lab3: calibrate measure=emulated, then plan_train with that;
# calibrate_quarter_pair: calibrate measure=emulated validating settings on that cluster
BY_HAND = {"plan_train_lab3", "calibrate_quarter_pair"}
VERSIONS = ("torch", "torchrec", "fbgemm_gpu")


def command(name: str) -> list[str]:
    """`python -m ...` that publishes the result set `name`."""
    args = next(a for n, _, a in PUBLISHED if n == name)
    module = args[0].split(".")[1]
    where = [] if name == module or name in _DEFAULT_DIR else [f"results_dir={RESULTS / name}"]
    return [sys.executable, "-m", *args, "save=true", *where]


def why_stale(name: str, installed: dict[str, str]) -> str | None:
    """Why the set `name` needs re-measuring (None: the installed stack measured it)."""
    file = RESULTS / name / next(f for n, f, _ in PUBLISHED if n == name)
    if not file.exists():
        return f"{file.relative_to(RESULTS.parent.parent)} is missing"
    env = json.loads(file.read_text()).get("environment", {})
    differ = [
        f"{k} {env.get(k)} (installed {installed[k]})"
        for k in VERSIONS
        if env.get(k) != installed[k]
    ]
    code = fingerprint.staleness(RESULTS / name)
    return ", ".join([*differ, *([code] if code else [])]) or None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.remeasure", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "sets", nargs="*", help="result sets to run, stale or not (default: every stale one)"
    )
    parser.add_argument("--list", action="store_true", help="only list the stale sets")
    args = parser.parse_args(argv)
    names = [n for n, _, _ in PUBLISHED]
    unknown = sorted(set(args.sets) - set(names))
    if unknown:
        parser.error(f"unknown result set(s) {unknown}; known: {', '.join(names)}")
    from benchmarks.common import environment
    from recsys.app.train import quiet_library_noise

    quiet_library_noise()
    installed = {k: environment()[k] for k in VERSIONS}
    stale = {n: why_stale(n, installed) for n in names}
    todo = args.sets or [n for n in names if stale[n]]
    for n in names:
        print(f"{n:32s} {'stale: ' + stale[n] if stale[n] else 'measured on the installed stack'}")
    if args.list or not todo:
        return 0
    for i, name in enumerate(todo, 1):
        cmd = command(name)
        print(f"\n[{i}/{len(todo)}] {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.monotonic()
        code = subprocess.run(cmd, cwd=RESULTS.parent.parent).returncode
        print(
            f"[{i}/{len(todo)}] {name}: exit {code} after {time.monotonic() - t0:.0f} s", flush=True
        )
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
