"""CPU intra-op threads (vllm/utils/cpu_threads.py, cpu_contention.py, omp_env.py): the
thread choice under a given affinity set and cgroup quota, the user's settings winning, the
bind-list format, and the contention detector's decisions on synthetic step times."""
from __future__ import annotations

import types

import pytest
import torch

from vllm.utils import cpu_contention as cc
from vllm.utils import cpu_threads as ct
from vllm.utils import omp_env

# ---------------------------------------------------------------------------------------
# CPU lists and VLLM_CPU_OMP_THREADS_BIND


@pytest.mark.parametrize("text,cpus", [("0", [0]), ("0-3", [0, 1, 2, 3]),
                                       ("0-1,4,6-7", [0, 1, 4, 6, 7]), (" 3 , 1-2 ", [1, 2, 3]),
                                       ("2,2,1-2", [1, 2])])
def test_parse_cpu_list(text, cpus):
    assert ct.parse_cpu_list(text) == cpus
    assert ct.parse_cpu_list(ct.format_cpu_list(cpus)) == cpus


@pytest.mark.parametrize("text", ["", "a", "0-", "-1", "3-1", "0,,1", "0-1-2", "1.5"])
def test_parse_cpu_list_rejects(text):
    with pytest.raises(ValueError, match="CPU"):
        ct.parse_cpu_list(text)


def test_format_cpu_list():
    assert ct.format_cpu_list([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert ct.format_cpu_list([]) == ""


@pytest.mark.parametrize("value,mode", [(None, "auto"), ("", "auto"), ("auto", "auto"),
                                        ("AUTO", "auto"), ("nobind", "nobind")])
def test_bind_spec_modes(value, mode):
    assert ct.parse_bind_spec(value, 2).mode == mode


def test_bind_spec_lists():
    spec = ct.parse_bind_spec("0-3|4-7", 2)
    assert spec.mode == "list"
    assert spec.rank_cpus == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert ct.parse_bind_spec("0,2", 1).rank_cpus == ((0, 2),)


@pytest.mark.parametrize("value,world,match", [
    ("0-3", 2, "1 CPU list.*2 tensor-parallel"),
    ("0-1|2-3", 1, "2 CPU list"),
    ("0-2|2-3", 2, "CPU 2 is in the lists of ranks 0 and 1"),
    ("0-1|", 2, "rank 1 list '' is empty"),
    ("bind", 1, "'bind' is not a CPU id"),
    ("0-x", 1, "'0-x' is not a CPU id"),
])
def test_bind_spec_rejects(value, world, match):
    with pytest.raises(ValueError, match=match):
        ct.parse_bind_spec(value, world)


# ---------------------------------------------------------------------------------------
# cgroup quota


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota(tmp_path):
    proc = tmp_path / "proc_cgroup"
    _write(proc, "0::/job/a\n")
    _write(tmp_path / "cg/job/a/cpu.max", "150000 100000\n")
    _write(tmp_path / "cg/cpu.max", "max 100000\n")  # the root's: the own group comes first
    limit, src = ct.cgroup_cpu_limit(str(tmp_path / "cg"), str(proc))
    assert limit == 1.5 and src.endswith("job/a/cpu.max")


def test_cgroup_v2_no_quota_and_container_root(tmp_path):
    proc = tmp_path / "proc_cgroup"
    _write(proc, "0::/\n")
    _write(tmp_path / "cg/cpu.max", "max 100000\n")
    assert ct.cgroup_cpu_limit(str(tmp_path / "cg"), str(proc))[0] is None
    _write(tmp_path / "cg/cpu.max", "200000 100000\n")
    assert ct.cgroup_cpu_limit(str(tmp_path / "cg"), str(proc))[0] == 2.0


def test_cgroup_v1_quota(tmp_path):
    proc = tmp_path / "proc_cgroup"
    _write(proc, "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    base = tmp_path / "cg/cpu,cpuacct/docker/abc"
    _write(base / "cpu.cfs_quota_us", "50000\n")
    _write(base / "cpu.cfs_period_us", "100000\n")
    limit, src = ct.cgroup_cpu_limit(str(tmp_path / "cg"), str(proc))
    assert limit == 0.5 and "docker/abc" in src
    _write(base / "cpu.cfs_quota_us", "-1\n")
    assert ct.cgroup_cpu_limit(str(tmp_path / "cg"), str(proc))[0] is None


def test_cgroup_none(tmp_path):
    assert ct.cgroup_cpu_limit(str(tmp_path / "nothing"), str(tmp_path / "none")) == (
        None, "no cgroup CPU quota found")


# ---------------------------------------------------------------------------------------
# The thread plan

NO_QUOTA = (None, "none")
FLAT = {c: (0, c) for c in range(16)}  # no SMT: one CPU per core


def plan(world=1, rank=0, env=None, affinity=range(4), quota=NO_QUOTA, current=4,
         default=4, nodes=None, topology=FLAT):
    return ct.plan_threads(world, rank, env=env or {}, affinity=list(affinity),
                           cgroup_limit=quota, nodes=nodes or [list(range(16))],
                           current_threads=current, default_threads=default,
                           topology=topology)


def test_plan_from_affinity():
    p = plan(affinity=[2, 3], current=2, default=2)
    assert (p.num_threads, p.explicit, p.bind_cpus) == (2, False, None)
    assert p.usable_cpus == (2, 3) and "2 CPUs in this process's affinity (2-3)" in p.reason


@pytest.mark.parametrize("quota,threads", [(1.5, 1), (0.5, 1), (2.0, 2), (3.99, 3), (8.0, 4)])
def test_plan_capped_by_cgroup_quota(quota, threads):
    p = plan(quota=(quota, "/sys/fs/cgroup/cpu.max"))
    assert p.num_threads == threads
    assert ("cgroup quota" in p.reason) == (threads < 4)


def test_plan_shared_across_tp_ranks():
    assert [plan(world=2, rank=r).num_threads for r in (0, 1)] == [2, 2]
    assert plan(world=8, rank=7).num_threads == 1
    assert "shared by 2 ranks" in plan(world=2).reason


def test_plan_smt_counts_cores():
    smt = {0: (0, 0), 1: (0, 1), 2: (0, 0), 3: (0, 1)}  # CPUs 2, 3 are 0, 1's siblings
    p = plan(topology=smt, current=2, default=4)
    assert p.num_threads == 2 and "2 physical cores" in p.reason and not p.explicit


def test_plan_auto_binds_numa_nodes_only_for_tp():
    nodes = [[0, 1, 2, 3], [4, 5, 6, 7]]
    r1 = plan(world=2, rank=1, affinity=range(8), nodes=nodes, current=8, default=8)
    assert r1.bind_cpus == (4, 5, 6, 7) and r1.num_threads == 4 and "NUMA node 1" in r1.reason
    assert plan(world=1, affinity=range(8), nodes=nodes, current=8,
                default=8).bind_cpus is None
    nobind = plan(world=2, rank=1, affinity=range(8), nodes=nodes, current=8, default=8,
                  env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    assert nobind.bind_cpus is None and nobind.num_threads == 4
    # One node: no binding (threads pinned to a taken core could not move away).
    assert plan(world=2, rank=1, affinity=range(8), current=8, default=8).bind_cpus is None


def test_omp_num_threads_wins():
    p = plan(env={"OMP_NUM_THREADS": "3"}, quota=(1.0, "q"))
    assert (p.num_threads, p.explicit) == (3, True) and "OMP_NUM_THREADS=3" in p.reason
    assert plan(env={"OMP_NUM_THREADS": "2,1"}).num_threads == 2  # libgomp's nested list
    assert plan(env={"OMP_NUM_THREADS": ""}).explicit is False


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_omp_num_threads_bad(value):
    with pytest.raises(ValueError, match=f"OMP_NUM_THREADS={value!r}"):
        plan(env={"OMP_NUM_THREADS": value})


def test_bind_list_wins_and_sets_count():
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3"}
    p = plan(world=2, rank=1, env=env)
    assert (p.num_threads, p.bind_cpus, p.explicit) == (2, (2, 3), True)
    with pytest.raises(ValueError, match="CPUs 6-7, which this process may not use"):
        plan(env={"VLLM_CPU_OMP_THREADS_BIND": "0-1,6-7"})
    # OMP_NUM_THREADS still decides the count; the list still decides where.
    p = plan(world=2, rank=0, env={**env, "OMP_NUM_THREADS": "1"})
    assert (p.num_threads, p.bind_cpus) == (1, (0, 1))


def test_torch_set_num_threads_before_start_wins():
    p = plan(current=3, default=4)
    assert (p.num_threads, p.explicit) == (3, True) and "torch.set_num_threads(3)" in p.reason
    assert plan(current=4, default=4).explicit is False


def test_own_earlier_choice_is_not_the_users(monkeypatch):
    monkeypatch.setattr(ct, "_last_set_by_us", 1)
    assert plan(current=1, default=4).explicit is False


def test_ray_actor_plans_from_its_host_capped_by_rays_share():
    # bench_pp's single-host cluster declared 7 CPUs on a 2-core machine: Ray's share for
    # each of 2 ranks on the node was 3 (OMP_NUM_THREADS=3, read as the user's before).
    share = {"OMP_NUM_THREADS": "3", ct.RAY_SHARE_ENV: "3:2:1"}
    p = plan(world=4, rank=3, env=share, affinity=range(2), current=3, default=2)
    assert (p.num_threads, p.explicit) == (1, False)
    assert "shared by 2 ranks" in p.reason and "OMP_NUM_THREADS" not in p.reason
    # A host with more cores than Ray gives the rank: Ray's share caps the count.
    p = plan(world=2, rank=0, env={"OMP_NUM_THREADS": "2", ct.RAY_SHARE_ENV: "2:1:0"},
             affinity=range(8), current=2, default=8)
    assert p.num_threads == 2 and "capped at the 2 CPUs Ray gives this rank" in p.reason
    # A bind list is still the user's choice inside an actor.
    p = plan(world=2, rank=1, env={**share, ct.RAY_SHARE_ENV: "3:2:1",
                                   "VLLM_CPU_OMP_THREADS_BIND": "0|1"}, affinity=range(2))
    assert (p.num_threads, p.bind_cpus, p.explicit) == (1, (1,), True)


@pytest.mark.parametrize("value", ["3", "0:2:0", "2:2:2", "a:b:c"])
def test_ray_share_bad(value):
    with pytest.raises(ValueError, match=f"{ct.RAY_SHARE_ENV}={value!r}"):
        plan(env={ct.RAY_SHARE_ENV: value})


def test_bad_rank():
    with pytest.raises(ValueError, match="rank 2 of world size 2"):
        plan(world=2, rank=2)


def test_apply_thread_plan_sets_torch_and_logs_once(monkeypatch):
    logged = []
    monkeypatch.setattr(ct, "logger", types.SimpleNamespace(info=logged.append))
    monkeypatch.setattr(ct, "_logged", set())
    saved = torch.get_num_threads()
    try:
        p = ct.ThreadPlan(1, "test reason", False, (0,))
        ct.apply_thread_plan(p)
        ct.apply_thread_plan(p)
        assert torch.get_num_threads() == 1
        assert len(logged) == 1 and "1 (rank 0): test reason" in logged[0]
    finally:
        torch.set_num_threads(saved)


def test_real_process_plan_is_sane():
    p = ct.plan_threads(1, 0)
    assert 1 <= p.num_threads and p.usable_cpus


# ---------------------------------------------------------------------------------------
# The contention detector (synthetic step times, 0.1 s steps, 0.25 s windows)


def run(det, windows, busy, step_s=0.1, shape=(1, 1), t0=0.0):
    """Feed `windows` windows of 3 steps each with others' use `busy`; the decisions."""
    out, t = [], t0
    for _ in range(windows):
        for _ in range(3):
            t += step_s
            d = det.observe(t, step_s, shape, lambda: busy)
            if d is not None:
                out.append(d)
    return out, t


def test_busy_core_drops_threads_and_comes_back():
    det = cc.ContentionDetector(full_threads=2, num_cpus=2)
    idle, t = run(det, 3, 0.05)
    assert idle == []  # idle: nothing
    first, t = run(det, 1, 1.0, t0=t)
    assert first == []  # one busy window is not enough
    ds, t = run(det, 1, 1.0, t0=t)
    assert [d.threads for d in ds] == [1] and det.threads == 1
    assert "OMP_NUM_THREADS=1" in ds[0].warn and "VLLM_CPU_OMP_THREADS_BIND" in ds[0].warn
    assert "taskset" in ds[0].warn and "~1.0 of the 2 CPUs" in ds[0].warn
    ds, t = run(det, 5, 1.0, t0=t)  # still busy: stays at 1, says nothing more
    assert ds == [] and det.threads == 1
    ds, t = run(det, 1, 0.1, t0=t)
    assert ds == []  # one calm window is not enough
    ds, t = run(det, 1, 0.1, t0=t)
    assert [d.threads for d in ds] == [2] and "contention over" in ds[0].info
    # A second episode: fewer threads again, but no second warning.
    ds, t = run(det, 2, 1.0, t0=t)
    assert [d.threads for d in ds] == [1] and ds[0].warn is None


def test_partial_busy_on_many_cpus():
    det = cc.ContentionDetector(full_threads=8, num_cpus=8)
    ds, _ = run(det, 2, 3.2)
    assert [d.threads for d in ds] == [5]  # 8 - 3.2 CPUs, rounded
    det = cc.ContentionDetector(full_threads=4, num_cpus=8)
    assert run(det, 4, 3.0)[0] == []  # 4 threads fit in the 5 CPUs left


def test_user_setting_is_never_changed_but_warned_once():
    det = cc.ContentionDetector(full_threads=2, num_cpus=2, adjust=False)
    ds, t = run(det, 2, 1.0)
    assert len(ds) == 1 and ds[0].threads is None and det.threads == 2
    assert "Your thread setting is kept" in ds[0].warn and "OMP_NUM_THREADS=1" in ds[0].warn
    assert run(det, 6, 1.0, t0=t)[0] == []


def test_unknown_cpu_use_falls_back_to_step_slowdown():
    det = cc.ContentionDetector(full_threads=2, num_cpus=2)
    _, t = run(det, 2, None, step_s=0.01)  # the best at this shape: 10 ms
    assert run(det, 1, None, step_s=0.02, t0=t)[0] == []  # 2x: not enough
    ds, _ = run(det, 2, None, step_s=0.2, t0=t)
    assert len(ds) == 1 and "20.0x slower" in ds[0].warn
    assert ds[0].threads is None and det.threads == 2  # no CPU figures: warn only


def test_slowdown_is_per_shape():
    det = cc.ContentionDetector(full_threads=2, num_cpus=2)
    _, t = run(det, 2, None, step_s=0.01, shape=(1, 1))
    # A bigger batch is slower, but it is its own shape: no contention.
    assert run(det, 4, None, step_s=0.2, shape=(16, 16), t0=t)[0] == []


def test_short_windows_wait_for_enough_steps():
    det = cc.ContentionDetector(full_threads=2, num_cpus=2, window_s=0.25, min_steps=2)
    assert det.observe(1.0, 1.0, (1, 1), lambda: 1.0) is None  # 1 step, even if long
    calls = []
    det.observe(1.5, 0.5, (1, 1), lambda: calls.append(1) or 1.0)
    assert calls == [1]


# ---------------------------------------------------------------------------------------
# The governor: the detector wired to /proc/stat and torch


def test_governor_applies_and_warns_once(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    clock = {"t": 0.0}
    busy = {"ticks": 0}
    hz = cc.os.sysconf("SC_CLK_TCK")

    def write():
        stat.write_text(f"cpu  0 0 0 0\ncpu0 {busy['ticks']} 0 0 1000 0 0 0 0 0 0\n"
                        "cpu1 0 0 0 1000 0 0 0 0 0 0\n")

    write()
    warned = []
    monkeypatch.setattr(cc, "logger", types.SimpleNamespace(warning=warned.append,
                                                            info=lambda m: None))
    monkeypatch.setattr(cc, "_logged", set())
    monkeypatch.setattr(cc.time, "process_time", lambda: 0.0)  # our own CPU use: none
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        gov = cc.ThreadGovernor(ct.ThreadPlan(2, "r", False, (0, 1)), clock=lambda: clock["t"],
                                stat_path=str(stat))
        for _ in range(12):  # another process keeps CPU 0 fully busy
            clock["t"] += 0.1
            busy["ticks"] += int(0.1 * hz)
            write()
            gov.step(0.1, (1, 1))
        assert torch.get_num_threads() == 1 and len(warned) == 1
        for _ in range(12):  # it stops
            clock["t"] += 0.1
            write()
            gov.step(0.1, (1, 1))
        assert torch.get_num_threads() == 2 and len(warned) == 1
        # A second engine in the same process meets the same busy CPU: no second warning.
        gov2 = cc.ThreadGovernor(ct.ThreadPlan(2, "r", False, (0, 1)),
                                 clock=lambda: clock["t"], stat_path=str(stat))
        for _ in range(12):
            clock["t"] += 0.1
            busy["ticks"] += int(0.1 * hz)
            write()
            gov2.step(0.1, (1, 1))
        assert torch.get_num_threads() == 1 and len(warned) == 1
    finally:
        torch.set_num_threads(saved)


def test_governor_leaves_explicit_threads(tmp_path):
    plan_ = ct.ThreadPlan(2, "OMP_NUM_THREADS=2 (yours)", True, (0, 1))
    assert cc.ThreadGovernor(plan_, stat_path=str(tmp_path / "x")).detector.adjust is False


def test_proc_stat_busy(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text("cpu  9 9 9 9\ncpu0 10 1 5 100 7 1 1 2 0 0\ncpu1 3 0 0 50 0 0 0 0 0 0\n")
    hz = cc.os.sysconf("SC_CLK_TCK")
    assert cc._proc_stat_busy([0], str(stat)) == pytest.approx(20 / hz)  # idle, iowait out
    assert cc._proc_stat_busy([0, 1], str(stat)) == pytest.approx(23 / hz)
    assert cc._proc_stat_busy([5], str(stat)) is None
    assert cc._proc_stat_busy([0], str(tmp_path / "none")) is None


# ---------------------------------------------------------------------------------------
# The worker's thread setup


def _worker(world=1):
    from vllm.engine.worker import Worker

    pc = types.SimpleNamespace(world_size=world)
    w = Worker.__new__(Worker)
    w.vllm_config = types.SimpleNamespace(parallel_config=pc)
    w.rank, w._saved_num_threads, w._thread_governor = 0, None, None
    w._saved_affinity = None
    return w


def test_worker_honours_omp_num_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    saved = torch.get_num_threads()
    try:
        w = _worker()
        w._init_cpu_threads()
        assert torch.get_num_threads() == 1
        assert w._thread_governor.detector.adjust is False
    finally:
        torch.set_num_threads(saved)


def test_worker_adaptive_switch(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("VLLM_CPU_ADAPTIVE_THREADS", "0")
    monkeypatch.setattr(ct, "_last_set_by_us", torch.get_num_threads())
    saved = torch.get_num_threads()
    try:
        w = _worker()
        w._init_cpu_threads()
        assert w._thread_governor.detector.adjust is False
    finally:
        torch.set_num_threads(saved)


def test_worker_execute_model_feeds_the_governor():
    w = _worker()
    seen = []
    w._thread_governor = types.SimpleNamespace(step=lambda s, shape: seen.append(shape))
    w.model_runner = types.SimpleNamespace(execute_model=lambda so: "out")
    so = types.SimpleNamespace(total_num_scheduled_tokens=3, num_scheduled_tokens={"a": 1,
                                                                                   "b": 2})
    assert w.execute_model(so) == "out" and seen == [(3, 2)]


# ---------------------------------------------------------------------------------------
# The OpenMP wait policy


def test_omp_env_user_wins():
    env = {"OMP_WAIT_POLICY": "active", "VLLM_CPU_OMP_WAIT_POLICY": "passive"}
    assert omp_env.omp_env_defaults(env) == {}
    assert omp_env.omp_env_defaults({"GOMP_SPINCOUNT": "0",
                                     "VLLM_CPU_OMP_WAIT_POLICY": "passive"}) == {}


def test_omp_env_choices(monkeypatch):
    assert omp_env.omp_env_defaults({"VLLM_CPU_OMP_WAIT_POLICY": "passive"}) == {
        "OMP_WAIT_POLICY": "PASSIVE"}
    assert omp_env.omp_env_defaults({"VLLM_CPU_OMP_WAIT_POLICY": "default"}) == {}
    monkeypatch.setattr(omp_env, "DEFAULT_OMP_ENV", {"GOMP_SPINCOUNT": "10000"})
    assert omp_env.omp_env_defaults({}) == {"GOMP_SPINCOUNT": "10000"}
    with pytest.raises(ValueError, match="VLLM_CPU_OMP_WAIT_POLICY='spin'"):
        omp_env.omp_env_defaults({"VLLM_CPU_OMP_WAIT_POLICY": "spin"})


def test_omp_env_default_is_libgomps_own():
    # The measured choice (vllm/utils/omp_env.py says why): PASSIVE cost 1.8-2.7x per token
    # on a quiet machine, so "auto" leaves libgomp's policy alone.
    assert omp_env.omp_env_defaults({}) == {}
    assert omp_env.omp_env_defaults({"VLLM_CPU_OMP_WAIT_POLICY": "auto"}) == {}


def test_describe_wait_policy(monkeypatch):
    monkeypatch.setattr(omp_env, "_applied", {})
    assert omp_env.describe_wait_policy({"GOMP_SPINCOUNT": "5"}) == "GOMP_SPINCOUNT=5"
    assert "libgomp's default" in omp_env.describe_wait_policy({})
    monkeypatch.setattr(omp_env, "_applied", {"OMP_WAIT_POLICY": "PASSIVE"})
    assert omp_env.describe_wait_policy({}) == "OMP_WAIT_POLICY=PASSIVE (set on import vllm)"


def test_omp_env_only_before_torch():
    env = {"VLLM_CPU_OMP_WAIT_POLICY": "passive"}
    assert omp_env.apply_omp_env_defaults(env, modules={"torch": object()}) == {}
    assert "OMP_WAIT_POLICY" not in env
    assert omp_env.apply_omp_env_defaults(env, modules={}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    bad = {"VLLM_CPU_OMP_WAIT_POLICY": "spin"}
    assert omp_env.apply_omp_env_defaults(bad, modules={}) == {}  # an import never fails


def test_import_vllm_sets_policy_before_torch(tmp_path):
    import os
    import subprocess
    import sys

    code = ("import os, sys; import vllm; assert 'torch' not in sys.modules; "
            "print(os.environ.get('OMP_WAIT_POLICY'))")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY",
                                                            "GOMP_SPINCOUNT")}
    root = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**env, "VLLM_CPU_OMP_WAIT_POLICY": "passive"}, check=True)
    assert out.stdout.strip() == "PASSIVE"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**env, "VLLM_CPU_OMP_WAIT_POLICY": "passive",
                              "OMP_WAIT_POLICY": "ACTIVE"}, check=True)
    assert out.stdout.strip() == "ACTIVE"


def test_busy_since_start_acts_at_the_first_window():
    det = cc.ContentionDetector(full_threads=2, num_cpus=2)
    det.start(0.0)
    d = det.end_window(3.0, lambda: 1.0)  # the start-up (3 s) with CPU 1 taken throughout
    assert d.threads == 1 and d.warn


def test_between_thresholds_keeps_the_current_count():
    det = cc.ContentionDetector(full_threads=2, num_cpus=2)
    det.start(0.0)
    assert det.end_window(1.0, 1.0).threads == 1
    for t in range(2, 10):  # 0.4 CPUs: neither contention nor calm
        assert det.end_window(float(t), 0.4) is None
    assert det.threads == 1
    assert det.end_window(10.6, 0.1).threads == 2  # 0.6 s calm


def test_one_thread_has_nothing_to_give_back():
    det = cc.ContentionDetector(full_threads=1, num_cpus=2, adjust=False)
    assert run(det, 6, 1.9)[0] == []  # OMP_NUM_THREADS=1 under load: no advice to set it
    _, t = run(det, 2, None, step_s=0.01)
    assert run(det, 4, None, step_s=0.5, t0=t)[0] == []


def test_bind_and_restore(monkeypatch):
    calls = []
    monkeypatch.setattr(ct.os, "sched_setaffinity", lambda tid, cpus: calls.append((tid,
                                                                                     cpus)))
    monkeypatch.setattr(ct, "affinity_cpus", lambda: [0, 1, 2, 3])
    monkeypatch.setattr(ct, "_logged", set())
    monkeypatch.setattr(ct, "logger", types.SimpleNamespace(info=lambda m: None))
    saved = torch.get_num_threads()
    try:
        before = ct.apply_thread_plan(ct.ThreadPlan(2, "list", True, (2, 3), (2, 3)))
        assert before == [0, 1, 2, 3]
        import threading

        bound = {tid for tid, _ in calls}  # every thread of the process, the caller's too
        assert threading.get_native_id() in bound and len(bound) == len(calls) >= 1
        assert all(cpus == {2, 3} for _, cpus in calls)
        assert ct.apply_thread_plan(ct.ThreadPlan(2, "no bind", False, (0, 1))) is None
    finally:
        torch.set_num_threads(saved)


def test_shape_memory_is_bounded():
    det = cc.ContentionDetector(full_threads=2, num_cpus=2)
    for n in range(3 * det.MAX_SHAPES):
        det.observe(n * 0.01, 0.01, (n, 1))
    assert len(det._best) <= det.MAX_SHAPES
