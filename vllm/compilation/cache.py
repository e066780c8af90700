"""On-disk compile cache for the compiled pieces.

Layout: `<root>/<key[:10]>/rank_<r>/` where root is `compilation_config.cache_dir` or
`<VLLM_CACHE_ROOT>/torch_compile_cache`, holding
  manifest.json            the key factors and, per artifact, its sha256, size and graph hash
  <piece>.<range>.bin      Inductor artifacts (`CompiledArtifact.save(format="binary")`)
  inductor_cache/          Inductor's own cache dir while we compile/load (keeps the built
                           C++ objects, so a warm start does not run the C++ compiler again)
  <piece>.<range>.light.json, light_kernels/<sha256>.so
                           the same pieces described for loading without Inductor
                           (inductor_light.py), and their kernels
  graph.pkl                the traced graph (graph_cache.py: warm starts without Dynamo)
  .lock                    fcntl lock held while one process compiles this key

The key covers everything that changes the compiled code (`VllmConfig.compute_hash()`, torch,
triton and our versions, the traced model source, our compiler source, the pass manager's
uuid, the CPU's instruction set) and nothing memory-sized. Writes are atomic (temp file +
os.replace); an entry whose checksum or size does not match the manifest, or that fails to
load, is logged, counted and recompiled, never trusted.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from vllm.compilation.counter import compilation_counter
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

MANIFEST = "manifest.json"
_FORMAT_VERSION = 1


LOCK_WAIT_LOG_SECONDS = 60.0
"""While another process holds a cache entry's lock (compiling the same piece), a warning every
this many seconds says who and how to go on without it."""


def _acquire_file_lock(path: str) -> int:
    """An exclusive flock on `path` (the holder's pid written in it); the fd. A wait is
    logged at once and then every LOCK_WAIT_LOG_SECONDS, naming the holder: the lock dies with
    its process, but a stopped or hung one would otherwise block the start silently."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _wait_for_lock(fd, path)
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def _wait_for_lock(fd: int, path: str) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    holder = _lock_holder(path)
    logger.info("compile cache: waiting for %s, which holds %s (compiling the same entry; "
                "this start then loads its result)", holder, path)
    last_log = time.monotonic()
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(0.05)
        if time.monotonic() - last_log >= LOCK_WAIT_LOG_SECONDS:
            last_log = time.monotonic()
            logger.warning("compile cache: still waiting for %s, which holds %s; if it is "
                           "hung, stop it, or start with VLLM_DISABLE_COMPILE_CACHE=1", holder,
                           path)


def _lock_holder(path: str) -> str:
    try:
        with open(path) as f:
            pid = f.read().strip()
    except OSError:
        pid = ""
    return f"process {pid}" if pid.isdigit() else "another process"


def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files_hash(paths: list[str | os.PathLike]) -> str:
    """Contents only (the same source installed elsewhere gives the same key)."""
    h = hashlib.sha256()
    for path in sorted(set(map(os.fspath, paths))):
        try:
            with open(path, "rb") as f:
                h.update(f.read())
        except OSError:
            h.update(b"<missing>")
    return h.hexdigest()


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return hashlib.sha256(line.encode()).hexdigest()[:16]
    except OSError:
        pass
    return platform.processor() or "unknown"


def compiler_source_files() -> list[str]:
    """Our compile stack's own source: a change in it may change the artifacts."""
    here = os.path.dirname(os.path.abspath(__file__))
    files = []
    for dirpath, _, names in os.walk(here):
        files += [os.path.join(dirpath, n) for n in names if n.endswith(".py")]
    return sorted(files)


def compute_cache_factors(vllm_config: VllmConfig, model_source_files: list[str],
                          pass_manager_uuid: str) -> dict[str, str]:
    """What the cache key is made of, each factor as a short string (stored in the manifest,
    so a person can see why two directories differ)."""
    import torch

    from vllm.version import __version__

    try:
        import triton  # noqa: F401

        triton_version = triton.__version__
    except Exception:
        triton_version = "none"
    return {
        "format": str(_FORMAT_VERSION),
        "config": vllm_config.compute_hash(),
        "torch": torch.__version__,
        "triton": triton_version,
        "vllm": __version__,
        "model_source": _files_hash(model_source_files),
        "compiler_source": _files_hash(compiler_source_files()),
        "passes": pass_manager_uuid,
        "machine": f"{platform.machine()}-{_cpu_flags()}",
        "accelerator": _accelerator(vllm_config),
    }


def _accelerator(vllm_config: VllmConfig) -> str:
    """The GPU the code is built for (Triton kernels target its architecture, and FP8 layers
    choose their GEMM by its capability): a cache shared by an A100 and an H100 must not hand
    one the other's artifacts. "none" off CUDA."""
    import torch

    if not vllm_config.platform.is_cuda() or not torch.cuda.is_available():
        return "none"
    major, minor = torch.cuda.get_device_capability()
    return f"cuda{torch.version.cuda}-{torch.cuda.get_device_name()}-sm{major}{minor}"


def compute_cache_key(factors: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()


def cache_root(vllm_config: VllmConfig) -> str:
    from vllm import envs

    configured = vllm_config.compilation_config.cache_dir
    if configured:
        return os.path.abspath(os.path.expanduser(configured))
    return os.path.join(envs.VLLM_CACHE_ROOT, "torch_compile_cache")


def cache_disabled_reason(vllm_config: VllmConfig) -> str | None:
    from vllm import envs

    if envs.VLLM_DISABLE_COMPILE_CACHE:
        return f"VLLM_DISABLE_COMPILE_CACHE={os.environ['VLLM_DISABLE_COMPILE_CACHE'].strip()}"
    if vllm_config.compilation_config.debug_dump_path:
        return "debug_dump_path is set: everything is compiled so that the dump is complete"
    if vllm_config.compilation_config.backend != "inductor":
        return f"backend {vllm_config.compilation_config.backend!r} produces nothing to cache"
    return cache_directory_problem(vllm_config)


def cache_directory_problem(vllm_config: VllmConfig) -> str | None:
    """Why the cache root cannot be written (named with the path), or None."""
    from vllm.config.utils import directory_problem

    root = cache_root(vllm_config)
    problem = directory_problem(root)
    return None if problem is None else f"the cache directory {root!r} is not usable: {problem}"


class CompileCache:
    """One key's directory: locked compiles, checksummed entries, atomic writes."""

    def __init__(self, directory: str, factors: dict[str, str] | None = None) -> None:
        self.directory = directory
        self.factors = factors or {}
        os.makedirs(directory, exist_ok=True)
        self._thread_lock = threading.RLock()
        self._lock_depth = 0
        self._lock_fd: int | None = None
        self.hits: list[str] = []
        self.misses: list[str] = []
        self.graph_loaded = False
        """The traced graph came from this entry too (graph_cache.py: Dynamo not run)."""

    @classmethod
    def for_model(cls, vllm_config: VllmConfig, model_source_files: list[str],
                  pass_manager_uuid: str, rank: int = 0) -> CompileCache:
        factors = compute_cache_factors(vllm_config, model_source_files, pass_manager_uuid)
        key = compute_cache_key(factors)
        directory = os.path.join(cache_root(vllm_config), key[:10], f"rank_{rank}")
        return cls(directory, factors)

    @property
    def inductor_cache_dir(self) -> str:
        return os.path.join(self.directory, "inductor_cache")

    @property
    def light_kernel_dir(self) -> str:
        """The kernels of the pieces that load without Inductor (inductor_light.py)."""
        return os.path.join(self.directory, "light_kernels")

    # ---- locking ---------------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Exclusive across processes (fcntl) and threads; re-entrant in one process."""
        with self._thread_lock:
            if self._lock_depth == 0:
                self._lock_fd = _acquire_file_lock(os.path.join(self.directory, ".lock"))
            self._lock_depth += 1
            try:
                yield
            finally:
                self._lock_depth -= 1
                if self._lock_depth == 0 and self._lock_fd is not None:
                    fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
                    os.close(self._lock_fd)
                    self._lock_fd = None

    # ---- manifest --------------------------------------------------------------------
    def _read_manifest(self) -> dict[str, Any]:
        path = os.path.join(self.directory, MANIFEST)
        try:
            with open(path) as f:
                data = json.load(f)
            if not isinstance(data.get("entries"), dict):
                raise ValueError("no entries")
            return data
        except FileNotFoundError:
            return {"factors": self.factors, "entries": {}}
        except (OSError, ValueError) as e:
            # Its entries can no longer be verified: counted as corrupt, and replaced by an
            # empty manifest at once so that the next read does not warn again.
            logger.warning("compile cache: manifest %s is unreadable (%s); starting it over "
                           "(its entries are recompiled)", path, e)
            compilation_counter.num_cache_corrupt += 1
            fresh = {"factors": self.factors, "entries": {}}
            with contextlib.suppress(OSError), self.lock():
                self._write_atomic(MANIFEST, lambda tmp: _write_json(tmp, fresh))
            return fresh

    def _write_atomic(self, name: str, write: Callable[[str], None]) -> str:
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{name}.", suffix=".tmp")
        os.close(fd)
        try:
            write(tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            final = os.path.join(self.directory, name)
            os.replace(tmp, final)
            return final
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def _update_manifest(self, name: str, entry: dict[str, Any] | None) -> None:
        with self.lock():
            manifest = self._read_manifest()
            manifest["factors"] = self.factors
            if entry is None:
                manifest["entries"].pop(name, None)
            else:
                manifest["entries"][name] = entry
            self._write_atomic(MANIFEST, lambda tmp: _write_json(tmp, manifest))

    # ---- entries ---------------------------------------------------------------------
    def path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def lookup(self, name: str, graph_hash: str) -> str | None:
        """Path of a verified entry, or None (missing, for another graph, or corrupt: then it
        is logged, counted and dropped)."""
        entry = self._read_manifest()["entries"].get(name)
        path = self.path(name)
        if entry is None or entry.get("graph_hash") != graph_hash:
            return None
        problem = None
        try:
            size = os.path.getsize(path)
            if size != entry.get("size"):
                problem = f"size {size} != {entry.get('size')} recorded (truncated?)"
            elif _sha256_file(path) != entry.get("sha256"):
                problem = "checksum mismatch"
        except OSError as e:
            problem = f"unreadable ({e})"
        if problem:
            self.drop(name, problem)
            return None
        return path

    def drop(self, name: str, problem: str) -> None:
        logger.warning("compile cache: corrupt entry %s in %s: %s; recompiling it", name,
                       self.directory, problem)
        compilation_counter.num_cache_corrupt += 1
        with contextlib.suppress(OSError):
            os.unlink(self.path(name))
        self._update_manifest(name, None)

    def reset_inductor_cache(self, problem: str) -> bool:
        """Empty this entry's Inductor cache (its built kernels and FX graph entries), which
        a piece that failed to load or compile may have read a damaged file from: Inductor
        would reuse the same file when compiling the piece again. False when it was empty."""
        directory = self.inductor_cache_dir
        if not os.path.isdir(directory) or not os.listdir(directory):
            return False
        logger.warning("compile cache: emptying %s (%s); its kernels are built again",
                       directory, problem)
        with self.lock():
            # Renamed first, so that no reader sees a half-deleted directory.
            trash = f"{directory}.removed-{os.getpid()}-{time.monotonic_ns()}"
            try:
                os.rename(directory, trash)
            except OSError:
                return False
            shutil.rmtree(trash, ignore_errors=True)
        return True

    def store(self, name: str, graph_hash: str, write: Callable[[str], None],
              count: bool = True) -> str:
        """Write an entry atomically (`write(tmp_path)` produces the file) and record it
        (`count`: in `num_cache_saves`)."""
        with self.lock():
            final = self._write_atomic(name, write)
            self._update_manifest(name, {"sha256": _sha256_file(final),
                                         "size": os.path.getsize(final),
                                         "graph_hash": graph_hash})
        if count:
            compilation_counter.num_cache_saves += 1
        return final

    def remove(self, name: str) -> None:
        """Forget an entry that is intact but not usable (a read-only cache keeps it)."""
        with contextlib.suppress(OSError):
            os.unlink(self.path(name))
        with contextlib.suppress(OSError):
            self._update_manifest(name, None)

    def record(self, name: str, hit: bool) -> None:
        (self.hits if hit else self.misses).append(name)
        if hit:
            compilation_counter.num_cache_hits += 1
        else:
            compilation_counter.num_cache_misses += 1

    def report(self) -> None:
        """The start-up line: hit when every artifact loaded, else miss."""
        if self.misses:
            logger.info("compile cache: miss (%d compiled, %d loaded) in %s", len(self.misses),
                        len(self.hits), self.directory)
        elif self.hits:
            what = ("artifacts and the traced graph loaded: Dynamo and Inductor" if
                    self.graph_loaded else "artifacts loaded, Inductor")
            logger.info("compile cache: hit (%d %s not run) in %s", len(self.hits), what,
                        self.directory)
