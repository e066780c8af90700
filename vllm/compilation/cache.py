"""On-disk compile cache: the compiled pieces and the traced graph, under one key.

Layout: `<root>/<key[:10]>/rank_<r>/` where root is `compilation_config.cache_dir` or
`<VLLM_CACHE_ROOT>/torch_compile_cache`, holding
  manifest.json            the key factors and, per entry, its sha256, size and graph hash
  <piece>.<range>.bin      Inductor artifacts (`CompiledArtifact.save(format="binary")`)
  inductor_cache/          Inductor's own cache dir while we compile/load (keeps the built
                           C++ objects, so a warm start does not run the C++ compiler again)
  <piece>.<range>.light.json, light_kernels/<sha256>.so
                           the same pieces described for loading without Inductor
                           (inductor_light.py), and their kernels
  graph.pkl                the traced graph (graph_cache.py: warm starts without Dynamo)
  .lock                    fcntl lock held while one process compiles this key
and `<root>/graph_index/<key of the factors without the traced files>.rank_<r>.json`: the
files Dynamo traced, the only part of the key a start cannot compute before tracing.

The interface the backend uses, one path for a hit and a miss:
  load_piece(name, key, compiler) -> (runnable, how) | None    store_piece(...)
  load_graph() -> record (raises GraphCacheMiss)                store_graph(record)
  CompileCache.for_model(...)  the entry to compile into; `find_saved_graph(...)` the entry a
                               traced graph was saved in (raises GraphCacheMiss)
A piece loads without Inductor from its light entry when it has one (inductor_light.py),
else through the compiler's full load, after which the light entry is written.

The key (cache_key.py) covers everything that changes the compiled code and nothing
memory-sized. Writes are atomic (`vllm.utils.file_utils`); an entry whose checksum or size does
not match the manifest, or that fails to load, is logged, counted and recompiled, never
trusted.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from vllm.compilation.cache_key import (  # noqa: F401 (the key's names, re-exported)
    cache_directory_problem,
    cache_disabled_reason,
    cache_root,
    compiler_source_files,
    compute_cache_factors,
    compute_cache_key,
    cpu_fingerprint,
    entry_directory,
    files_hash,
    index_path,
    sha256_file,
)
from vllm.compilation.counter import compilation_counter
from vllm.logger import init_logger
from vllm.utils.file_utils import atomic_path, atomic_write

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

MANIFEST = "manifest.json"
GRAPH_ENTRY = "graph.pkl"
GRAPH_TAG = "traced-graph"  # the graph entry's "graph_hash" in the manifest


class GraphCacheMiss(Exception):
    """The saved traced graph cannot be used; the message says why."""


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
        self.dropped: list[str] = []
        """Entries dropped as damaged in this process."""
        self.traced_files: list[str] = []
        self.index_path: str | None = None
        """Where `store_graph` files `traced_files` (set by `for_model`)."""

    @classmethod
    def for_model(cls, vllm_config: VllmConfig, model_source_files: list[str],
                  pass_manager_uuid: str, rank: int = 0,
                  traced_files: list[str] | tuple[str, ...] = ()) -> CompileCache:
        """The entry for this model and config: `traced_files` are the files Dynamo traced
        (in the key; a traced graph saved here records them in the index)."""
        base = compute_cache_factors(vllm_config, model_source_files, pass_manager_uuid)
        factors = base if not traced_files else {
            **base, "model_source": files_hash([*model_source_files, *traced_files])}
        root = cache_root(vllm_config)
        cache = cls(entry_directory(root, factors, rank), factors)
        cache.traced_files = list(traced_files)
        cache.index_path = index_path(root, base, rank)
        return cache

    @classmethod
    def find_saved_graph(cls, vllm_config: VllmConfig, model_source_files: list[str],
                         pass_manager_uuid: str, rank: int = 0) -> CompileCache:
        """The entry a traced graph was saved in for this model and config, found without
        tracing: the traced files come from the index. Raises GraphCacheMiss."""
        base = compute_cache_factors(vllm_config, model_source_files, pass_manager_uuid)
        root = cache_root(vllm_config)
        index = index_path(root, base, rank)
        try:
            with open(index) as f:
                traced = [str(p) for p in json.load(f)["traced_files"]]
        except FileNotFoundError:
            raise GraphCacheMiss("none saved for this model and config yet") from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise GraphCacheMiss(f"the index {index} is unreadable ({e})") from None
        factors = {**base, "model_source": files_hash([*model_source_files, *traced])}
        directory = entry_directory(root, factors, rank)
        if not os.path.isdir(directory):
            raise GraphCacheMiss("no cache entry for the current source of the traced files")
        cache = cls(directory, factors)
        cache.traced_files, cache.index_path = traced, index
        return cache

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
        final = self.path(name)
        with atomic_path(final, fsync=True) as tmp:
            write(tmp)
        return final

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
            elif sha256_file(path) != entry.get("sha256"):
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
        self.dropped.append(name)
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
            self._update_manifest(name, {"sha256": sha256_file(final),
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

    # ---- compiled pieces -------------------------------------------------------------
    @staticmethod
    def piece_entry(piece_index: int, range_tag: str) -> str:
        """The entry name of piece `piece_index` compiled for the range with `range_tag`."""
        return f"piece_{piece_index}.{range_tag}.bin"

    def load_piece(self, name: str, key: str, compiler: Any) -> tuple[Callable, str] | None:
        """The piece stored as `name` for `key` and how it loaded: "hit (without Inductor)"
        from its light entry, else "hit" (the compiler's full load, after which the light
        entry is written for the next start). None when there is none: missing, for another
        key, or damaged (then dropped, counted, and Inductor's cache emptied, so that the
        caller's compile does not reuse a damaged kernel). A hit is recorded."""
        path = self.lookup(name, key)
        if path is None:
            return None
        light = self._load_light(name, key)
        if light is not None:
            self.record(name, hit=True)
            return light, "hit (without Inductor)"
        try:
            artifact = compiler.load(path, self.inductor_cache_dir)
        except Exception as e:  # a damaged entry is recompiled, never trusted
            problem = f"failed to load ({type(e).__name__}: {e})"
            self.drop(name, problem)
            # The damage may be in a kernel Inductor built (a .so), which it would reuse.
            self.reset_inductor_cache(f"{name} {problem}")
            return None
        self._store_light(name, key, path)
        self.record(name, hit=True)
        return artifact, "hit"

    def store_piece(self, name: str, key: str, compiler: Any, artifact: Any) -> None:
        """Record the miss of a piece just compiled and save it as `name` for `key` (with
        its light entry when it runs without Inductor); a failure to save is logged."""
        self.record(name, hit=False)
        try:
            path = self.store(name, key, lambda tmp: compiler.save(artifact, tmp))
        except Exception as e:
            logger.warning("compile cache: could not save %s: %s", name, e)
            return
        self._store_light(name, key, path)

    def _load_light(self, name: str, key: str) -> Callable | None:
        """Piece `name` run without importing Inductor, from its light entry; None when there
        is none or it does not load (logged; the light entry is dropped, and the piece,
        loaded the full way, writes it again)."""
        light_name = _light_entry(name)
        path = self.lookup(light_name, key)
        if path is None:
            return None
        from vllm.compilation import inductor_light

        try:
            with open(path) as f:
                record = json.load(f)
            piece = inductor_light.load(record, self.light_kernel_dir, name.removesuffix(".bin"))
        except inductor_light.DamagedKernel as e:
            logger.warning("compile cache: %s: %s; loading the piece with Inductor",
                           light_name, e)
            compilation_counter.num_cache_corrupt += 1
            self.remove(light_name)
            return None
        except Exception as e:
            logger.info("compile cache: %s not used (%s: %s); loading the piece with Inductor",
                        light_name, type(e).__name__, e)
            self.remove(light_name)
            return None
        compilation_counter.num_light_loads += 1
        return piece

    def _store_light(self, name: str, key: str, artifact_path: str) -> None:
        """Write the light entry of piece `name` (just compiled or loaded the full way, its
        artifact at `artifact_path`) when the piece can run without Inductor."""
        from vllm.compilation import inductor_light

        try:
            record = inductor_light.describe(artifact_path, self.inductor_cache_dir,
                                             self.light_kernel_dir)
        except inductor_light.NotLight as e:
            logger.debug("%s needs Inductor at every start: %s", name, e)
            return
        except Exception as e:
            logger.info("compile cache: %s not described for loading without Inductor "
                        "(%s: %s)", name, type(e).__name__, e)
            return
        text = json.dumps(record)

        def write(tmp: str) -> None:
            with open(tmp, "w") as f:
                f.write(text)

        try:
            self.store(_light_entry(name), key, write, count=False)
        except Exception as e:
            logger.warning("compile cache: could not save %s: %s", _light_entry(name), e)

    # ---- the traced graph ------------------------------------------------------------
    def load_graph(self) -> dict[str, Any]:
        """The traced-graph record saved in this entry (graph_cache.py). Raises
        GraphCacheMiss when it is missing or damaged."""
        import pickle

        path = self.lookup(GRAPH_ENTRY, GRAPH_TAG)
        if path is None:
            raise GraphCacheMiss(f"{GRAPH_ENTRY} is missing or damaged in {self.directory}")
        with open(path, "rb") as f:
            record = pickle.load(f)
        if not isinstance(record, dict):
            raise GraphCacheMiss(f"{GRAPH_ENTRY} holds a {type(record).__name__}")
        return record

    def store_graph(self, record: dict[str, Any]) -> None:
        """Save the traced-graph record, and file `traced_files` in the index so that a
        later start finds this entry before tracing; a failure is logged."""
        import pickle

        data = pickle.dumps(record)

        def write(tmp: str) -> None:
            with open(tmp, "wb") as f:
                f.write(data)

        try:
            self.store(GRAPH_ENTRY, GRAPH_TAG, write)
            if self.index_path is not None:
                atomic_write(self.index_path, json.dumps({"traced_files": self.traced_files}))
        except Exception as e:
            logger.warning("compile cache: could not save %s: %s", GRAPH_ENTRY, e)
            return
        compilation_counter.num_graphs_saved += 1

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


def _light_entry(name: str) -> str:
    """The light entry of piece entry `name` (`piece_2.range_1_2048.bin`)."""
    return name.removesuffix(".bin") + ".light.json"
