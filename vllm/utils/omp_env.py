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

# What "auto" sets: nothing, i.e. libgomp's own policy (spin up to 300k iterations at a
# barrier, then sleep). PASSIVE (sleep at once) was the first choice: beside a busy core on a
# loaded machine it cut 643 ms per token to 4-30 ms with the contention governor off. But on a
# quiet 2-core machine (benchmarks/results/busy_core.md, -O2, batch 1, fresh processes,
# interleaved rounds) its wake-up per parallel region costs 2.7x per token idle on the demo
# model (4.39 against 1.36-1.61 ms) and 1.8x on the 50M Llama (16.8 against 8.2-9.4 ms), while
# the contention governor alone (vllm/utils/cpu_contention.py: one thread while a core is
# taken) keeps the busy figure within 1.5-2.0x of idle at the default policy. Idle speed is
# what most users have, so the default stays libgomp's; VLLM_CPU_OMP_WAIT_POLICY=passive (or
# OMP_WAIT_POLICY) chooses PASSIVE where cores are shared and the governor is off.
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
