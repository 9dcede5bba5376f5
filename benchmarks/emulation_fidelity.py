"""`python -m benchmarks.emulation_fidelity`: is an emulated rank's CFS quota a slower core?

A real slow device is slow all the time. A rank in a cpu cgroup with a quota of `share` of
each CFS period is slow only while it computes without a break: a wait (on the network)
leaves the rest of that period's quota unused, and after it the rank computes at a whole
core's speed until the quota runs out. So the longer the period, the more of a rank's
compute hides in its waits. Each row runs a loop of `compute_ms` of CPU work (at one
core's speed) and a `wait_ms` sleep in a cgroup made as `recsys.emulation` makes a rank's,
at each period, and sets its wall time per iteration beside a core slowed to the share
(compute / share + wait) and beside a whole core (compute + wait). Needs root.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from benchmarks.common import benchmark_command, environment, finish, start
from recsys import CONF_DIR

REPO = Path(__file__).resolve().parents[1]

# the loop each row times, run in its own interpreter inside the cgroup: CPU seconds are
# counted on the thread's clock, so the loop does the same work whatever the quota
_LOOP = """
import sys, time
compute_s, wait_s, iterations = map(float, sys.argv[1:4])
def work(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
work(0.2)
start = time.perf_counter()
for _ in range(int(iterations)):
    work(compute_s)
    time.sleep(wait_s)
print((time.perf_counter() - start) / iterations)
"""


@dataclass
class FidelityConfig:
    share: float = 0.25
    # 0: the emulator's default, the shortest period at which the share's quota is 1 ms
    periods_us: list[int] = field(default_factory=lambda: [0, 10_000, 100_000])
    # (compute, wait) per iteration, ms: a step's phases on a slow rank of an emulated cluster
    loops_ms: list[list[float]] = field(
        default_factory=lambda: [[10.0, 40.0], [5.0, 10.0], [30.0, 30.0], [2.0, 2.0]]
    )
    iterations: int = 40
    save: bool = False  # also write benchmarks/results/ (see common.output_dirs)
    results_dir: str = str(REPO / "benchmarks" / "results" / "emulation_fidelity")


def period_for(share: float, period_us: int) -> int:
    """The period the emulator uses for a rank at `share` (0: its default)."""
    from sharding.cluster import shortest_cfs_period_us

    return period_us or shortest_cfs_period_us(share)


def loop_s(share: float, period_us: int, compute_s: float, wait_s: float, iterations: int) -> float:
    """Wall seconds per iteration of the compute-and-wait loop in a fresh cgroup holding
    `share` of each `period_us` period (`recsys.emulation.capped_cgroup`, as a rank's)."""
    from recsys import emulation

    with emulation.capped_cgroup(share, period_us) as cgroup:
        procs = cgroup / "cgroup.procs"
        out = subprocess.run(
            [sys.executable, "-c", _LOOP, str(compute_s), str(wait_s), str(iterations)],
            preexec_fn=lambda: procs.write_text(str(os.getpid())),
            capture_output=True,
            text=True,
            check=True,
            timeout=600,
        )
        return float(out.stdout)


def run(cfg: FidelityConfig) -> dict:
    rows = []
    for compute_ms, wait_ms in cfg.loops_ms:
        slow = compute_ms / cfg.share + wait_ms
        for asked in cfg.periods_us:
            period = period_for(cfg.share, asked)
            ms = 1e3 * loop_s(cfg.share, period, compute_ms / 1e3, wait_ms / 1e3, cfg.iterations)
            rows.append(
                {
                    "compute_ms": compute_ms,
                    "wait_ms": wait_ms,
                    "period_us": period,
                    "default_period": asked == 0,
                    "measured_ms": ms,
                    "slow_core_ms": slow,
                    "whole_core_ms": compute_ms + wait_ms,
                    "vs_slow_core": ms / slow,
                }
            )
            print(
                f"{compute_ms:g} ms + {wait_ms:g} ms at {period / 1e3:g} ms periods: "
                f"{ms:.1f} ms ({ms / slow:.2f}x a slow core's)",
                flush=True,
            )
    return {
        "rows": rows,
        "config": OmegaConf.to_container(OmegaConf.structured(cfg)),
        "environment": environment(),
    }


def table(r: dict) -> str:
    c, env = r["config"], r["environment"]
    lines = [
        f"# A CFS quota of {c['share']} of a core against a core slowed to {c['share']} "
        f"({env['date']}, {env['cpus']} CPUs, kernel {os.uname().release})",
        "",
        "| compute + wait per iteration | CFS period | measured ms | slow core ms "
        "| whole core ms | measured / slow core |",
        "|---|---|---|---|---|---|",
    ]
    for x in r["rows"]:
        default = " (default)" if x["default_period"] else ""
        lines.append(
            f"| {x['compute_ms']:g} + {x['wait_ms']:g} ms | {x['period_us'] / 1e3:g} ms"
            f"{default} | {x['measured_ms']:.1f} | {x['slow_core_ms']:.1f} | "
            f"{x['whole_core_ms']:.1f} | {x['vs_slow_core']:.2f}x |"
        )
    return "\n".join(lines)


ConfigStore.instance().store(name="base_bench_emulation_fidelity", node=FidelityConfig)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="bench_emulation_fidelity")
@benchmark_command
def main(cfg: DictConfig) -> None:
    typed: FidelityConfig = start(cfg)
    result = run(typed)
    finish(result, table(result), "emulation_fidelity", typed)


if __name__ == "__main__":
    main()
