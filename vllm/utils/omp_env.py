"""The OpenMP wait policy of torch's thread pool, set before torch is imported.

libgomp (torch's OpenMP runtime) reads OMP_WAIT_POLICY / GOMP_SPINCOUNT once, when torch is
imported; set later they do nothing. So `vllm/__init__.py` calls `apply_omp_env_defaults()`
on `import vllm`, which adds the chosen policy to os.environ only if torch is not imported
yet and the user set neither variable (theirs always win). Stdlib only: `import vllm` stays
cheap.

VLLM_CPU_OMP_WAIT_POLICY picks it: "auto" (default: `DEFAULT_OMP_ENV`), "passive" / "active"
(OMP_WAIT_POLICY=PASSIVE / ACTIVE), or "default" (libgomp's own: spin up to 300k iterations
at a barrier, then sleep).
"""
from __future__ import annotations

import os
import sys

WAIT_POLICY_ENVS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
POLICY_ENV = "VLLM_CPU_OMP_WAIT_POLICY"

# What "auto" sets. Nothing yet: with one core taken by another process the engine's
# contention governor (vllm/utils/cpu_threads.py) drops to fewer threads, and then no thread
# waits at a barrier for a descheduled partner, whatever the policy; idle, a sleeping (PASSIVE)
# thread pays a wake-up at each of the ~100 parallel regions of a decode step. On a loaded
# 2-core dev machine the variants did not separate from the noise; benchmarks/
# bench_busy_core.py measures libgomp's default against PASSIVE and GOMP_SPINCOUNT=10000, idle
# and with a busy core, and this is the place to change if one wins.
DEFAULT_OMP_ENV: dict[str, str] = {}


def omp_env_defaults(env=None) -> dict[str, str]:
    """The OpenMP variables to add to `env`: none when the user set OMP_WAIT_POLICY or
    GOMP_SPINCOUNT. ValueError for a VLLM_CPU_OMP_WAIT_POLICY that is not a policy."""
    env = os.environ if env is None else env
    choice = env.get(POLICY_ENV, "").strip().lower()
    if choice not in ("", "auto", "default", "passive", "active"):
        raise ValueError(f"{POLICY_ENV}={env.get(POLICY_ENV)!r} is not a wait policy; use "
                         "auto, passive, active or default (libgomp's own)")
    if any(env.get(k, "").strip() for k in WAIT_POLICY_ENVS):
        return {}
    if choice in ("", "auto"):
        return dict(DEFAULT_OMP_ENV)
    if choice == "default":
        return {}
    return {"OMP_WAIT_POLICY": choice.upper()}


def apply_omp_env_defaults(env=None, modules=None) -> dict[str, str]:
    """Add the policy to `env` (os.environ) unless torch is imported already (in `modules`,
    sys.modules). A bad VLLM_CPU_OMP_WAIT_POLICY sets nothing here (an import must not fail);
    the engine reports it when it starts (`check_omp_env`). Returns what was set."""
    env = os.environ if env is None else env
    modules = sys.modules if modules is None else modules
    if "torch" in modules:
        return {}
    try:
        extra = omp_env_defaults(env)
    except ValueError:
        return {}
    env.update(extra)
    return extra


def check_omp_env(env=None) -> None:
    """Raise the ValueError for a bad VLLM_CPU_OMP_WAIT_POLICY (the engine's start-up)."""
    omp_env_defaults(env)
