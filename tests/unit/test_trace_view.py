"""benchmarks.trace_view: the share of the all-to-all under compute, from a Chrome trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.trace_view import main, read_trace


def _trace(path: Path, events: list[tuple[str, int, float, float]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [
        {"ph": "X", "name": n, "tid": t, "ts": a * 1e3, "dur": (b - a) * 1e3}
        for n, t, a, b in events
    ]
    path.write_text(json.dumps({"traceEvents": rows}))


def test_overlap_is_the_all_to_all_time_inside_main_thread_ops(tmp_path: Path, capsys) -> None:
    main_ops = [("aten::addmm", 1, 0, 4), ("aten::add", 1, 6, 8), ("aten::mm", 1, 7, 9)] * 1
    _trace(
        tmp_path / "nested" / "traces" / "rank0.json",
        main_ops + [("gloo:all_to_all", 2, 2, 7), ("gloo:all_reduce", 2, 9, 10)],
    )
    _trace(tmp_path / "plain" / "traces" / "rank0.json", main_ops + [("gloo:all_to_all", 2, 4, 6)])
    t = read_trace(tmp_path / "nested" / "traces" / "rank0.json")
    assert t["all_to_all_ms"] == pytest.approx(5.0)
    assert t["overlap"] == pytest.approx(3 / 5)  # 2-4 and 6-7 inside ops, 4-6 not
    assert read_trace(tmp_path / "plain" / "traces" / "rank0.json")["overlap"] == 0
    out = tmp_path / "t.png"
    assert main([str(tmp_path / "plain"), str(tmp_path / "nested"), "--out", str(out)]) == 0
    assert out.stat().st_size > 1000 and "| nested | 0 | 5.0 | 60% |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(tmp_path / "none"), "--out", str(out)])
