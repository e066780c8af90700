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

# What "auto" sets: PASSIVE (a thread that finds no work sleeps at once). libgomp's default
# spins up to 300k iterations at every barrier first; with a core taken by another process the
# thread spinning for its descheduled partner burns the time slices that partner needs, at
# each of the ~100 parallel regions of a decode step. Measured on the shared 2-core dev machine
# (benchmarks/bench_busy_core.py, demo model, -O0, batch 1, 2 threads, the contention governor
# off, one process each, the machine loaded by other jobs too): with a busy core 643 ms per
# token at libgomp's default, 111 ms with GOMP_SPINCOUNT=10000, 4-30 ms with PASSIVE; without
# the busy core (the other jobs only) 128-202 / 77 / 18-28 ms. Its cost on a quiet machine (a
# wake-up per region instead of a spin) is the `after` against `after_gomp_default` rows of
# that benchmark: if it loses there, this is the place to change.
DEFAULT_OMP_ENV: dict[str, str] = {"OMP_WAIT_POLICY": "PASSIVE"}


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
    if env is os.environ:
        _applied.update(extra)
    return extra


_applied: dict[str, str] = {}


def check_omp_env(env=None) -> None:
    """Raise the ValueError for a bad VLLM_CPU_OMP_WAIT_POLICY (the engine's start-up)."""
    omp_env_defaults(env)


def describe_wait_policy(env=None) -> str:
    """The policy in force, for the start-up log (`env` holds what libgomp read if torch was
    imported after vllm)."""
    env = os.environ if env is None else env
    if _applied:
        return ", ".join(f"{k}={v}" for k, v in _applied.items()) + " (set on import vllm)"
    theirs = [f"{k}={env[k]}" for k in WAIT_POLICY_ENVS if env.get(k, "").strip()]
    if theirs:
        return ", ".join(theirs)
    return ("libgomp's default (torch was imported before vllm, or VLLM_CPU_OMP_WAIT_POLICY="
            "default; OMP_WAIT_POLICY=PASSIVE in the environment sets it)")
