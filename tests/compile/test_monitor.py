"""StartupTimer: phases, repeated phases, table and dict views, the global instance."""
from __future__ import annotations

import time

from vllm.compilation.monitor import StartupTimer, get_startup_timer, reset_startup_timer


def test_phases_are_timed_summed_and_ordered():
    timer = StartupTimer()
    with timer.phase("weight loading"):
        time.sleep(0.01)
    with timer.phase("config resolution"):
        pass
    timer.record("inductor compilation", 1.5, piece=0, cache="miss")
    timer.record("inductor compilation", 0.5, piece=1, cache="hit")
    with timer.phase("my custom phase") as info:
        info["note"] = "x"
    assert timer.seconds("weight loading") >= 0.01
    assert timer.seconds("inductor compilation") == 2.0
    assert timer.count("inductor compilation") == 2
    # Standard phases come in start-up order, others after them.
    assert timer.phases() == ["config resolution", "weight loading", "inductor compilation",
                              "my custom phase"]
    data = timer.as_dict()
    assert data["phases"]["inductor compilation"]["events"][1] == {
        "seconds": 0.5, "piece": 1, "cache": "hit"}
    assert data["phases"]["my custom phase"]["events"][0]["note"] == "x"
    assert abs(data["total_seconds"] - sum(p["seconds"] for p in data["phases"].values())) < 1e-6


def test_table_lists_phases_and_details():
    timer = StartupTimer()
    timer.record("cudagraph capture", 0.25, size=8)
    timer.record("cudagraph capture", 0.25, size=4)
    timer.record("inductor compilation", 1.0, cache="hit")
    timer.record("inductor compilation", 1.0, cache="hit")
    table = timer.table()
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["phase", "seconds", "count"]
    capture = next(line for line in lines if line.startswith("cudagraph capture"))
    assert "0.50" in capture and " 2 " in capture
    assert "cache: 2 hit" in table
    assert lines[-1].startswith("total")


def test_global_timer_and_reset():
    timer = reset_startup_timer()
    assert get_startup_timer() is timer
    timer.record("warm-up", 0.1)
    assert get_startup_timer().seconds("warm-up") == 0.1
    reset_startup_timer()
    assert get_startup_timer().phases() == []


def test_phase_records_even_when_the_block_raises():
    timer = StartupTimer()
    try:
        with timer.phase("kv cache allocation"):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert timer.count("kv cache allocation") == 1


def test_an_outer_phase_leaves_out_the_phases_recorded_inside_it():
    """On CUDA the KV cache sizing runs the first forward, so the Dynamo trace and the compiles
    happen inside "kv cache allocation": counted in both rows, the table's rows summed to 19.3 s
    against 10.75 s of wall time."""
    timer = StartupTimer()
    start = time.perf_counter()
    with timer.phase_around("kv cache allocation", ("dynamo tracing", "inductor compilation")):
        time.sleep(0.02)
        with timer.phase("dynamo tracing"):
            time.sleep(0.05)
        with timer.phase("inductor compilation"):
            time.sleep(0.05)
    wall = time.perf_counter() - start
    outer = timer.seconds("kv cache allocation")
    assert 0.015 < outer < 0.05, outer
    total = sum(timer.seconds(n) for n in ("kv cache allocation", "dynamo tracing",
                                           "inductor compilation"))
    assert abs(total - wall) < 0.01
