"""Inductor's CPU vector-ISA probe, remembered between processes.

Before its first CPU compile or load in a process, Inductor checks every vector ISA the CPU
reports (avx2, avx512, ...): it builds a test library with that ISA's flags (kept in its
cache) and loads it in a child Python process, one per ISA: about 1 s per start on the dev
machines, on the path of a warm start. The answers only change with the machine, the C++
compiler, torch or the Python that loads the libraries, so they are kept in
`<compile cache root>/inductor_vec_isa.json` under a fingerprint of those, and a later start
with the same fingerprint answers Inductor's checks from it (a check it has no answer for
still runs). Not used with the compile cache off or an explicit `vec_isa_ok` in Inductor's
config.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from typing import Any

from vllm.logger import init_logger

logger = init_logger(__name__)

MEMO = "inductor_vec_isa.json"


def _fingerprint() -> dict[str, Any]:
    import torch
    from torch._inductor import config

    from vllm.compilation.cache import _cpu_flags

    cxx = config.cpp.cxx
    compiler = None
    for name in cxx if isinstance(cxx, (list, tuple)) else (cxx,):
        path = shutil.which(name) if name else None
        if path:
            real = os.path.realpath(path)
            stat = os.stat(real)
            compiler = f"{real}:{stat.st_size}:{int(stat.st_mtime)}"
            break
    env = {k: os.environ.get(k) for k in ("CXX", "CPATH", "LD_LIBRARY_PATH")}
    return {"torch": torch.__version__, "python": sys.executable, "cpu": _cpu_flags(),
            "compiler": compiler, "env": env}


def pick_vec_isa(directory: str | None) -> None:
    """`torch._inductor.cpu_vec_isa.pick_vec_isa()`, with its build checks answered from the
    memo in `directory` where it has them (None: probe as Inductor does)."""
    from torch._inductor import config, cpu_vec_isa

    if directory is None or config.cpp.vec_isa_ok is not None or \
            not hasattr(cpu_vec_isa.VecISA, "check_build"):
        cpu_vec_isa.pick_vec_isa()
        return
    path = os.path.join(directory, MEMO)
    fingerprint = _fingerprint()
    saved: dict[str, bool] = {}
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("fingerprint") == fingerprint:
            saved = {k: v for k, v in data["results"].items() if isinstance(v, bool)}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    original = cpu_vec_isa.VecISA.check_build
    seen: dict[str, bool] = {}

    def check_build(isa: Any, code: str) -> bool:
        digest = hashlib.sha256(code.encode()).hexdigest()[:16]
        key = f"{isa}|{getattr(isa, '_arch_flags', '')}|{digest}"
        result = saved[key] if key in saved else bool(original(isa, code))
        seen[key] = result
        return result

    cpu_vec_isa.VecISA.check_build = check_build
    try:
        picked = cpu_vec_isa.pick_vec_isa()
    finally:
        cpu_vec_isa.VecISA.check_build = original
    if all(key in saved for key in seen):
        logger.debug("Inductor vector ISA %s (checks from %s)", picked, path)
        return
    try:
        os.makedirs(directory, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"fingerprint": fingerprint, "results": {**saved, **seen}}, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        logger.debug("could not save the Inductor vector-ISA checks: %s", e)
