"""StartupTimer: phases, repeated phases, table and dict views, the global instance."""
from __future__ import annotations

import os
import time

from vllm.utils.startup_timer import StartupTimer, get_startup_timer, reset_startup_timer


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


def test_a_cpu_kernel_build_is_a_row_of_its_own(tmp_path, monkeypatch):
    """The first start on a machine builds the C++ CPU kernels (~8 s each on 2 cores): the
    build is its own row, taken out of the phase it happened in (it was counted as weight
    loading / Dynamo tracing)."""
    import torch.utils.cpp_extension

    from vllm.utils import cpu_kernels
    from vllm.utils.startup_timer import CPU_KERNEL_BUILD

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "root"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    def build(name, build_directory, **kwargs) -> None:  # a "build" that takes 0.1 s
        time.sleep(0.1)
        open(os.path.join(build_directory, f"{name}.so"), "w").close()

    monkeypatch.setattr(torch.utils.cpp_extension, "load", build)
    timer = reset_startup_timer()
    start = time.perf_counter()
    with timer.phase_around("weight loading", (CPU_KERNEL_BUILD,)):
        time.sleep(0.02)
        assert cpu_kernels.load_cpu_extension(
            "monitor_test_kernel", str(tmp_path / "k.cpp"), "VLLM_MONITOR_TEST_KERNEL",
            source_text="// nothing")
    wall = time.perf_counter() - start
    events = timer.as_dict()["phases"][CPU_KERNEL_BUILD]["events"]
    assert [e["kernel"] for e in events] == ["monitor_test_kernel"]
    assert 0.1 <= timer.seconds(CPU_KERNEL_BUILD) < 0.15
    assert timer.seconds("weight loading") < 0.08
    assert abs(timer.seconds("weight loading") + timer.seconds(CPU_KERNEL_BUILD) - wall) < 0.01
    assert timer.phases().index(CPU_KERNEL_BUILD) == timer.phases().index("weight loading") + 1


def test_timer_lives_outside_compilation(tmp_path):
    """The engine and utils time their start-up without importing the compile stack, and
    nothing imports the timer's old module (vllm.compilation.monitor, gone)."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    code = ("import sys, vllm.utils.startup_timer\n"
            "bad = sorted(m for m in sys.modules if m.startswith('vllm.compilation'))\n"
            "assert not bad, bad\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    from test_import_cycles import import_graph

    graph = import_graph()
    users = sorted(m for m, deps in graph.items() if "vllm.compilation.monitor" in deps)
    assert not users, f"import the timer from vllm.utils.startup_timer: {users}"


def test_events_taken_from_a_workers_timer_become_rows_not_warm_up():
    """Under Ray every rank is an actor: its compiles were timed in the actor's process and the
    engine's table showed them as "warm-up". The executor now adds rank 0's events (taken from
    its timer) inside the phase they happened in."""
    from vllm.engine.executor import UniProcExecutor

    worker_timer = StartupTimer()

    class RemoteRankExecutor(UniProcExecutor):
        def __init__(self):  # no worker of its own: rank 0 "lives elsewhere"
            pass

        def _call_all(self, method, *args):
            if method == "compile_or_warm_up_model":  # the whole call is the compile
                start = time.perf_counter()
                time.sleep(0.2)
                worker_timer.record("inductor compilation", time.perf_counter() - start,
                                    piece=0)
            return [4]

        def _log_kv_cache(self):
            pass

        def _worker_startup_events(self):
            return worker_timer.take_events()

    timer = reset_startup_timer()
    RemoteRankExecutor()._start("auto")
    assert timer.seconds("inductor compilation") >= 0.2
    assert timer.count("inductor compilation") == 1
    # (counted as warm-up before: >= 0.2 s; now only the call around the compile)
    assert timer.seconds("warm-up") < 0.1, timer.as_dict()
    assert worker_timer.take_events() == []  # taken once: a second call adds nothing
    other = StartupTimer()
    other.add_events([("graph loading", 0.5, {"piece": 1})])
    assert other.as_dict()["phases"]["graph loading"]["events"] == [{"seconds": 0.5,
                                                                     "piece": 1}]
    reset_startup_timer()
