"""How many intra-op threads the CPU engine runs, on which CPUs, and what it does when other
processes take some of those CPUs.

The parts, each usable alone (the tests drive each with fake inputs):

* `plan_threads` decides the thread count from the CPUs this process may use: its affinity
  set (`os.sched_getaffinity`, i.e. taskset / a cpuset) and its cgroup CPU quota (cgroup v2
  `cpu.max`, v1 `cpu.cfs_quota_us / cpu.cfs_period_us`), shared across the tensor-parallel
  ranks. A user's own choice always wins: `OMP_NUM_THREADS`, an explicit
  `VLLM_CPU_OMP_THREADS_BIND` list, or a `torch.set_num_threads` made before the engine
  started. `apply_thread_plan` sets it and logs the choice and its reason once.
* `parse_bind_spec` reads `VLLM_CPU_OMP_THREADS_BIND` in upstream's format: "auto" (the
  default), "nobind", or CPU lists such as "0-3" or "0-3|4-7" (one list per TP rank).
* The OpenMP wait policy lives in `vllm/utils/omp_env.py` (applied on `import vllm`, before
  torch's import, so it must stay free of heavy imports).
* `vllm/utils/cpu_contention.py` notices when another process is busy on the engine's CPUs,
  warns once naming the fix, and runs fewer threads while that lasts (never when the user
  chose the thread count).

Why fewer threads: torch's parallel regions (one per linear layer, ~100 per decode step) end
at a barrier that waits for every thread. A thread that shares its core with a busy process
runs only in its share of the time slices, so every region waits for it: a 2-thread step on
2 cores with one core taken ran 15-25x slower than the same step on 1 thread (issue 21).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from vllm.logger import init_logger

logger = init_logger(__name__)

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_SELF_CGROUP = "/proc/self/cgroup"
NUMA_ROOT = "/sys/devices/system/node"

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
# Set by the Ray executor on each CPU actor, "<CPUs Ray gives the rank>:<ranks on its node>:
# <its index there>": the OMP_NUM_THREADS Ray's actor sees is then ours (set so that Ray's own
# default of 1 does not apply), a cap on the plan rather than the user's choice.
RAY_SHARE_ENV = "VLLM_CPU_RAY_THREAD_SHARE"

# ---------------------------------------------------------------------------------------
# CPU lists and the bind setting


def parse_cpu_list(text: str, what: str = "CPU list") -> list[int]:
    """ "0-3,8,10-11" -> [0, 1, 2, 3, 8, 10, 11] (sorted, no duplicates). ValueError naming
    the bad part for anything else (empty parts, reversed ranges, non-numbers)."""
    cpus: set[int] = set()
    text = text.strip()
    if not text:
        raise ValueError(f"{what} {text!r} is empty; expected CPU ids such as '0-3' or '0,2,4'")
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            first = int(lo)
            last = int(hi) if sep else first
        except ValueError:
            raise ValueError(f"{what} {text!r}: {part!r} is not a CPU id or a range like "
                             "'0-3'") from None
        if first < 0 or last < first:
            raise ValueError(f"{what} {text!r}: {part!r} is not a range of CPU ids (ids are "
                             ">= 0, written low-high)")
        cpus.update(range(first, last + 1))
    return sorted(cpus)


def format_cpu_list(cpus) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


@dataclass(frozen=True)
class BindSpec:
    """VLLM_CPU_OMP_THREADS_BIND, parsed: mode "auto" | "nobind" | "list"; for "list", one
    CPU list per tensor-parallel rank."""

    mode: str
    rank_cpus: tuple[tuple[int, ...], ...] = ()


def parse_bind_spec(value: str | None, world_size: int = 1) -> BindSpec:
    """Upstream's format: "auto" (default, also when unset or empty), "nobind", or CPU lists
    separated by "|", one per rank ("0-3|4-7" for TP=2). ValueError for anything else, for a
    count of lists that is not the world size, and for lists that overlap."""
    text = (value or "").strip()
    if text.lower() in ("", "auto"):
        return BindSpec("auto")
    if text.lower() == "nobind":
        return BindSpec("nobind")
    parts = text.split("|")
    lists = tuple(tuple(parse_cpu_list(p, f"{BIND_ENV} rank {i} list"))
                  for i, p in enumerate(parts))
    if len(lists) != world_size:
        raise ValueError(
            f"{BIND_ENV}={text!r} gives {len(lists)} CPU list(s) for {world_size} "
            f"tensor-parallel rank(s); give one list per rank separated by '|' (e.g. "
            f"'0-3|4-7'), or 'auto' / 'nobind'")
    seen: dict[int, int] = {}
    for rank, cpus in enumerate(lists):
        for c in cpus:
            if c in seen:
                raise ValueError(f"{BIND_ENV}={text!r}: CPU {c} is in the lists of ranks "
                                 f"{seen[c]} and {rank}; each rank needs its own CPUs")
            seen[c] = rank
    return BindSpec("list", lists)


# ---------------------------------------------------------------------------------------
# The CPUs this process may use


def affinity_cpus() -> list[int]:
    """The CPUs the calling thread may run on (taskset, cpuset); all CPUs where unknown."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def read_text_or_none(path: str) -> str | None:
    """A small file's stripped text; None where it cannot be read."""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cgroup_cpu_limit(root: str = CGROUP_ROOT,
                     proc_cgroup: str = PROC_SELF_CGROUP) -> tuple[float | None, str]:
    """The cgroup CPU quota in CPUs (quota / period; 1.5 = one and a half CPUs) and the file
    it came from; (None, reason) when there is none. cgroup v2 (`cpu.max`: "max 100000" or
    "150000 100000") is tried first, then v1 (`cpu.cfs_quota_us`, -1 = none, over
    `cpu.cfs_period_us`), each in this process's own cgroup directory and then at the root of
    the mount (what a container sees)."""
    own_v2, own_v1 = "", ""
    text = read_text_or_none(proc_cgroup) or ""
    for line in text.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            own_v2 = path
        elif "cpu" in controllers.split(","):
            own_v1 = path
    candidates_v2 = [os.path.normpath(os.path.join(root, own_v2.lstrip("/"), "cpu.max")),
                     os.path.join(root, "cpu.max")]
    for path in dict.fromkeys(candidates_v2):
        value = read_text_or_none(path)
        if value is None:
            continue
        quota, _, period = value.partition(" ")
        if quota == "max":
            return None, f"{path}: no quota"
        try:
            return int(quota) / int(period or 100000), path
        except (ValueError, ZeroDivisionError):
            return None, f"{path}: unreadable ({value!r})"
    for sub in ("cpu,cpuacct", "cpu", "cpuacct,cpu"):
        for base in dict.fromkeys([os.path.normpath(os.path.join(root, sub,
                                                                  own_v1.lstrip("/"))),
                                   os.path.join(root, sub)]):
            quota, period = (read_text_or_none(os.path.join(base, "cpu.cfs_quota_us")),
                             read_text_or_none(os.path.join(base, "cpu.cfs_period_us")))
            if quota is None or period is None:
                continue
            try:
                q, p = int(quota), int(period)
            except ValueError:
                return None, f"{base}: unreadable quota {quota!r} / period {period!r}"
            if q <= 0 or p <= 0:
                return None, f"{base}/cpu.cfs_quota_us: no quota"
            return q / p, f"{base}/cpu.cfs_quota_us"
    return None, "no cgroup CPU quota found"


def numa_nodes(root: str = NUMA_ROOT) -> list[list[int]]:
    """The CPUs of each NUMA node (one list per node, by node id); [] where unknown."""
    try:
        names = sorted((n for n in os.listdir(root) if n.startswith("node") and n[4:].isdigit()),
                       key=lambda n: int(n[4:]))
    except OSError:
        return []
    nodes = []
    for n in names:
        text = read_text_or_none(os.path.join(root, n, "cpulist"))
        if text:
            try:
                nodes.append(parse_cpu_list(text))
            except ValueError:
                return []
    return nodes


# ---------------------------------------------------------------------------------------
# The thread plan


@dataclass(frozen=True)
class ThreadPlan:
    """What a worker runs with: `num_threads` intra-op threads, on `bind_cpus` (None: where
    the OS puts them, within the process's affinity), chosen for `reason`. `explicit`: the
    user chose the count (OMP_NUM_THREADS, a bind list, torch.set_num_threads), so nothing
    changes it later. `usable_cpus`: the CPUs the threads may run on."""

    num_threads: int
    reason: str
    explicit: bool
    usable_cpus: tuple[int, ...]
    bind_cpus: tuple[int, ...] | None = None


def _omp_num_threads(env) -> int | None:
    raw = env.get("OMP_NUM_THREADS", "").strip()
    if not raw:
        return None
    first = raw.split(",")[0].strip()  # libgomp takes a list per nesting level
    try:
        n = int(first)
    except ValueError:
        raise ValueError(f"OMP_NUM_THREADS={raw!r} is not a thread count; use a positive "
                         "integer such as 1 or 4") from None
    if n < 1:
        raise ValueError(f"OMP_NUM_THREADS={raw!r} is not a thread count; use a positive "
                         "integer such as 1 or 4")
    return n


def plan_threads(world_size: int = 1, rank: int = 0, *, env=None,
                 affinity: list[int] | None = None,
                 cgroup_limit: tuple[float | None, str] | None = None,
                 nodes: list[list[int]] | None = None,
                 current_threads: int | None = None,
                 default_threads: int | None = None,
                 topology: dict[int, tuple[int, int]] | None = None) -> ThreadPlan:
    """The intra-op thread plan of `rank` of `world_size` tensor-parallel ranks on this
    machine. The inputs default to the real process (environment, affinity, cgroup, NUMA
    nodes, torch's thread count now and its default); tests pass them.

    Order: OMP_NUM_THREADS (yours) > a VLLM_CPU_OMP_THREADS_BIND list for this rank (as many
    threads as CPUs) > a torch.set_num_threads made before the engine started (the current
    count differs from torch's default) > the usable CPUs: the affinity set, capped by the
    cgroup quota (whole CPUs, at least 1), shared evenly across the ranks. "auto" binding
    gives each rank one NUMA node where the machine has several and TP > 1; on one node it
    binds nothing (pinned threads cannot move off a core another process takes)."""
    env = os.environ if env is None else env
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of world size {world_size} is not a valid rank")
    if env.get(RAY_SHARE_ENV):
        return _ray_actor_plan(env, affinity, cgroup_limit, nodes, topology)
    spec = parse_bind_spec(env.get(BIND_ENV), world_size)
    cpus = sorted(affinity) if affinity is not None else affinity_cpus()
    omp = _omp_num_threads(env)

    bind: tuple[int, ...] | None = None
    if spec.mode == "list":
        bind = spec.rank_cpus[rank]
        outside = sorted(set(bind) - set(cpus))
        if outside:
            raise ValueError(
                f"{BIND_ENV} gives rank {rank} CPUs {format_cpu_list(outside)}, which this "
                f"process may not use (its affinity is {format_cpu_list(cpus)}); use CPUs "
                "from that set, or 'auto' / 'nobind'")
    if omp is not None:
        return ThreadPlan(omp, f"OMP_NUM_THREADS={omp} (yours)", True,
                          bind or tuple(cpus), bind)
    if bind is not None:
        return ThreadPlan(len(bind), f"{BIND_ENV}: rank {rank} on CPUs "
                          f"{format_cpu_list(bind)}", True, bind, bind)

    if current_threads is None or default_threads is None:
        import torch

        current_threads = torch.get_num_threads() if current_threads is None else current_threads
        default_threads = (torch_default_threads() if default_threads is None
                           else default_threads)
    defaults = {default_threads, _cores(cpus, topology), _last_set_by_us}
    if current_threads not in defaults:
        return ThreadPlan(current_threads, f"torch.set_num_threads({current_threads}) made "
                          "before the engine started, or MKL_NUM_THREADS (yours)", True,
                          tuple(cpus))

    limit, limit_src = cgroup_limit if cgroup_limit is not None else cgroup_cpu_limit()
    usable = _cores(cpus, topology)
    why = f"{len(cpus)} CPUs in this process's affinity ({format_cpu_list(cpus)})"
    if usable < len(cpus):
        why += f", {usable} physical cores among them (one thread per core)"
    if limit is not None and math.floor(limit) < usable:
        usable = max(1, math.floor(limit))
        why += f", cgroup quota {limit:g} CPUs ({limit_src})"
    if world_size > 1 and spec.mode == "auto":
        nodes = numa_nodes() if nodes is None else nodes
        nodes = [sorted(set(n) & set(cpus)) for n in nodes]
        nodes = [n for n in nodes if n]
        if len(nodes) > 1:
            node_id = rank % len(nodes)
            sharers = [r for r in range(world_size) if r % len(nodes) == node_id]
            node = nodes[node_id]
            size = max(1, len(node) // len(sharers))
            i = sharers.index(rank)
            share = node[i * size:(i + 1) * size] or node[-size:]
            threads = min(_cores(share, topology), max(1, usable // world_size))
            return ThreadPlan(threads, f"{why}; TP={world_size}: rank {rank} bound to NUMA "
                              f"node {node_id} (CPUs {format_cpu_list(share)})",
                              False, tuple(share), tuple(share))
    threads = max(1, usable // world_size)
    if world_size > 1:
        why += f", shared by {world_size} ranks (tensor/pipeline parallel)"
    return ThreadPlan(threads, why, False, tuple(cpus), None)


def _ray_actor_plan(env, affinity, cgroup_limit, nodes, topology) -> ThreadPlan:
    """A Ray CPU actor's plan: this host's CPUs shared by the ranks on its node, capped by the
    CPUs Ray gives the rank (a node may declare more CPUs than the host has cores)."""
    raw = env[RAY_SHARE_ENV]
    try:
        allotted, ranks, index = (int(v) for v in raw.split(":"))
        if allotted < 1 or ranks < 1 or not 0 <= index < ranks:
            raise ValueError
    except ValueError:
        raise ValueError(f"{RAY_SHARE_ENV}={raw!r} is not '<cpus>:<ranks>:<index>' (set by the "
                         "Ray executor; unset it)") from None
    local_env = {k: v for k, v in env.items() if k not in (RAY_SHARE_ENV, "OMP_NUM_THREADS")}
    # current == default: a count torch took from our OMP_NUM_THREADS is not the user's.
    plan = plan_threads(ranks, index, env=local_env, affinity=affinity,
                        cgroup_limit=cgroup_limit, nodes=nodes, current_threads=0,
                        default_threads=0, topology=topology)
    if plan.explicit or plan.num_threads <= allotted:
        return plan
    return ThreadPlan(allotted, f"{plan.reason}; capped at the {allotted} CPUs Ray gives this "
                      "rank", False, plan.usable_cpus, plan.bind_cpus)


def torch_default_threads() -> int:
    """The count torch starts with when nobody sets one: its OpenMP runtime's default, the
    CPUs in the affinity set when torch was imported (OMP_NUM_THREADS, which changes it, is
    handled before this is asked). Physical cores are accepted too (`plan_threads`)."""
    return _startup_affinity


def cpu_topology(root: str = "/sys/devices/system/cpu") -> dict[int, tuple[int, int]]:
    """CPU id -> (package id, core id); {} where unknown."""
    out = {}
    try:
        names = [n for n in os.listdir(root) if n.startswith("cpu") and n[3:].isdigit()]
    except OSError:
        return {}
    for n in names:
        core = read_text_or_none(os.path.join(root, n, "topology", "core_id"))
        pkg = read_text_or_none(os.path.join(root, n, "topology", "physical_package_id"))
        if core is None:
            continue
        try:
            out[int(n[3:])] = (int(pkg or 0), int(core))
        except ValueError:
            continue
    return out


def _cores(cpus, topology: dict[int, tuple[int, int]] | None = None) -> int:
    """Physical cores among `cpus` (SMT siblings count once); len(cpus) where unknown."""
    topology = cpu_topology() if topology is None else topology
    if not topology or any(c not in topology for c in cpus):
        return len(cpus)
    return max(1, len({topology[c] for c in cpus}))


# The affinity size when this module was first imported (torch's OpenMP runtime sized its
# default from the affinity at torch's import, which is before any of our code rebinds it).
_startup_affinity: int | None = len(affinity_cpus())
# The count our own apply_thread_plan set last (a second engine in the same process must not
# take it for the user's choice).
_last_set_by_us: int | None = None
_logged: set[str] = set()


def bind_process(cpus) -> int:
    """Restrict every thread of this process (the OpenMP pool included, which already exists
    once torch has run a parallel region) to `cpus`. Returns how many threads were bound."""
    cpus = set(cpus)
    n = 0
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
            n += 1
        except OSError:  # a thread that ended meanwhile
            pass
    return n


def apply_thread_plan(plan: ThreadPlan, rank: int = 0) -> list[int] | None:
    """Set torch's intra-op threads (and binding) to `plan`; log the choice once per
    process and plan. Returns the affinity before binding (None: nothing was bound), for
    `bind_process` to restore at shutdown."""
    import torch

    global _last_set_by_us
    previous = None
    if plan.bind_cpus is not None:
        previous = affinity_cpus()
        bind_process(plan.bind_cpus)
    if torch.get_num_threads() != plan.num_threads:
        torch.set_num_threads(plan.num_threads)
    if not plan.explicit:
        _last_set_by_us = plan.num_threads
    from vllm.utils.omp_env import describe_wait_policy

    msg = (f"CPU intra-op threads: {plan.num_threads} (rank {rank}): {plan.reason}"
           + (f"; bound to CPUs {format_cpu_list(plan.bind_cpus)}" if plan.bind_cpus else "")
           + f"; OpenMP wait policy: {describe_wait_policy()}")
    if msg not in _logged:
        _logged.add(msg)
        logger.info(msg)
    return previous
