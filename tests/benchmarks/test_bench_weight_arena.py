"""benchmarks/bench_weight_arena.py end to end on the demo model (a smoke run): both weight
layouts timed in one engine, the table and the JSON written."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_smoke_run_times_both_layouts(tmp_path):
    out = tmp_path / "arena"
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_weight_arena.py"), "--shape",
         "demo", "--rounds", "2", "--tokens", "4", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads((tmp_path / "arena.json").read_text())
    assert set(data["step_ms"]) == {"arena", "per_tensor"}
    assert all(len(v) == 2 and min(v) > 0 for v in data["step_ms"].values())
    shares = data["huge_page_share"]
    if data["huge_pages_enabled"]:  # the arena advises every byte; per tensor only whole pages
        assert shares["arena"] == 1.0 and shares["per_tensor"] < 1.0
    else:
        assert shares == {"arena": 0.0, "per_tensor": 0.0}
    assert "arena / per_tensor step time" in (tmp_path / "arena.md").read_text()
