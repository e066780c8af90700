"""What Inductor computes once per process before its first CPU load, remembered between
processes under the compile-cache root (both were on the path of every warm start).

- The vector-ISA probe: Inductor checks every vector ISA the CPU reports (avx2, avx512, ...)
  by building a test library with its flags and loading it in a child Python process, one per
  ISA (about 1 s on the dev machines). The answers only change with the machine, the C++
  compiler, torch or the Python that loads the libraries: `inductor_vec_isa.json` keeps them
  under a fingerprint of those, and a later start with the same fingerprint answers Inductor's
  checks from it (a check it has no answer for still runs). Not used with an explicit
  `vec_isa_ok` in Inductor's config.
- `torch_key()`, the hash of torch's Python source that every Inductor artifact is checked
  against (0.1-0.2 s of reading files): `inductor_torch_key.json` keeps it under torch's
  version, location and the times of its files' directories (as our cache key, it assumes a
  torch install is not edited in place without that showing), and sets it with Inductor's own
  `torch_key.set()`.

- The precompiled header's check: before it loads or builds any C++ kernel, Inductor runs
  the C++ preprocessor over its prefix header and hashes the output (a g++ -E child process:
  0.13-0.15 s of every warm start on the dev machines) to find its precompiled header.
  `inductor_pch.json` keeps the header path it found per header, flags, compiler and torch
  fingerprint; a later start returns it while the precompiled file is still there.

None is used with the compile cache off (no directory).

Why patch Inductor rather than set its options: torch 2.13 has no hook for either answer.
`config.cpp.vec_isa_ok` would skip the probe only as "every ISA the CPU lists builds", and,
being an Inductor option, it is part of Inductor's cache keys (a warm start would miss the
cold start's FX-graph entries); the header check has no option at all. So `pick_vec_isa`
wraps `VecISA.check_build` for the one call and `memoize_precompiled_header` replaces
`codecache._precompile_header` (both still run Inductor's own code for an unknown answer).
Only a full Inductor load or compile gets here: a warm start whose pieces load without
Inductor (inductor_light.py) never imports it.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
from typing import Any

from vllm.logger import init_logger

logger = init_logger(__name__)

MEMO = "inductor_vec_isa.json"
TORCH_KEY_MEMO = "inductor_torch_key.json"
PCH_MEMO = "inductor_pch.json"


def _fingerprint() -> dict[str, Any]:
    import torch
    from torch._inductor import config

    from vllm.compilation.cache_key import cpu_fingerprint

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
    return {"torch": torch.__version__, "python": sys.executable, "cpu": cpu_fingerprint(),
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
    saved = _read_entries(path, fingerprint, "results", bool)
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
    _write_json(directory, MEMO, {"fingerprint": fingerprint,
                                  "results": {**saved, **seen}})


def _read_entries(path: str, fingerprint: Any, field: str, kind: type) -> dict[str, Any]:
    """The memo's `field` entries of type `kind` when the file at `path` was written under the
    same fingerprint; otherwise (none yet, another machine or torch, damaged) none."""
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("fingerprint") == fingerprint:
            return {k: v for k, v in data[field].items() if isinstance(v, kind)}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return {}


def _write_json(directory: str, name: str, data: dict[str, Any]) -> None:
    from vllm.utils.file_utils import atomic_write

    try:
        atomic_write(os.path.join(directory, name), json.dumps(data, indent=1))
    except OSError as e:
        logger.debug("could not save %s: %s", name, e)


def _torch_fingerprint() -> dict[str, Any]:
    import torch

    root = os.path.dirname(os.path.abspath(torch.__file__))
    times = {}
    for sub in ("", "_inductor", "_dynamo", "_functorch", "fx"):
        path = os.path.join(root, sub)
        with contextlib.suppress(OSError):
            times[sub or "."] = os.stat(path).st_mtime_ns
    return {"torch": torch.__version__, "root": root, "dir_times": times}


def prefill_torch_key(directory: str | None) -> None:
    """Compute Inductor's `torch_key()` now (`prepare_inductor`), or set it from the memo
    in `directory`."""
    from torch._inductor.codecache import torch_key

    if directory is None or not hasattr(torch_key, "set"):
        torch_key()
        return
    path = os.path.join(directory, TORCH_KEY_MEMO)
    fingerprint = _torch_fingerprint()
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("fingerprint") == fingerprint:
            with contextlib.suppress(RuntimeError):  # already computed in this process
                torch_key.set(bytes.fromhex(data["key"]))
            return
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    _write_json(directory, TORCH_KEY_MEMO, {"fingerprint": fingerprint,
                                            "key": torch_key().hex()})


def memoize_precompiled_header(directory: str | None, codecache: Any = None) -> None:
    """Answer Inductor's `_precompile_header(header, cmd_line, **options)` from the memo in
    `directory` where it has the answer and the precompiled file (`<path>.gch`) still exists;
    otherwise Inductor runs its check (and builds the header when needed) and the answer is
    added. Installed once per process, before Inductor's first C++ load."""
    if codecache is None:
        from torch._inductor import codecache
    original = getattr(codecache, "_precompile_header", None)
    if directory is None or original is None or getattr(original, "_vllm_memo", False):
        return
    fingerprint = json.dumps([_fingerprint(), _torch_fingerprint()], sort_keys=True,
                             default=str)
    saved = _read_entries(os.path.join(directory, PCH_MEMO), fingerprint, "headers", str)

    def precompile_header(*args: Any, **kwargs: Any) -> str:
        # str(), not repr(): an option's repr may hold an address (the vector ISA's does)
        key = hashlib.sha256(json.dumps([[str(a) for a in args],
                                         sorted((k, str(v)) for k, v in kwargs.items())]
                                        ).encode()).hexdigest()
        header = saved.get(key)
        if header is not None and os.path.isfile(header) and os.path.isfile(header + ".gch"):
            return header
        header = original(*args, **kwargs)
        if isinstance(header, str):
            saved[key] = header
            _write_json(directory, PCH_MEMO, {"fingerprint": fingerprint, "headers": saved})
        return header

    precompile_header._vllm_memo = True  # type: ignore[attr-defined]
    codecache._precompile_header = precompile_header
