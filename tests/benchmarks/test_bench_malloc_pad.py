"""benchmarks/bench_malloc_pad.py end to end on the demo model (a smoke run): both variants
measured in their own processes, the table and the JSON written."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_smoke_run_writes_both_variants(tmp_path):
    out = tmp_path / "pad"
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_malloc_pad.py"), "--shape",
         "demo", "-O", "0", "--steps", "2", "--rounds", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads((tmp_path / "pad.json").read_text())
    assert set(data["results"]) == {"pad", "no_pad"}
    for runs in data["results"].values():
        assert len(runs) == 1 and runs[0]["prefill_s"] > 0 and runs[0]["peak_rss_mb"] > 0
    table = (tmp_path / "pad.md").read_text()
    assert "| prefill steps, sum (s) |" in table and "pad / no_pad" in table
