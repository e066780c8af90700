"""`compilation_config.debug_dump_path`: files a person reads to see what the compiler did,
and the error raised when a compile stage fails.

Per rank (`<path>/rank_<r>/`):
  graph.dynamo.py                       the graph Dynamo captured
  piece_<i>.py                          each piece after splitting at the splitting ops
  piece_<i>/<range>/post_grad.<j>.<Pass>.{before,after}.py   each pass on each piece compile
  inductor_output_code.txt              where Inductor wrote the generated code, per piece
  config.json                           the resolved config with provenance
  failure.txt                           after a failed compile: the error and its traceback
  index.md                              this list, one line per file
"""
from __future__ import annotations

import json
import os
import threading
from typing import TYPE_CHECKING, Any

import torch.fx as fx

from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)


class CompilationStageError(RuntimeError):
    """A compile failure at -O1+, naming the stage that failed. The original exception is
    chained (`__cause__`)."""

    def __init__(self, stage: str, piece_index: int | None = None, dump_dir: str | None = None,
                 detail: str = "") -> None:
        self.stage = stage
        self.piece_index = piece_index
        self.dump_dir = dump_dir
        self.detail = detail
        super().__init__(self._message())

    def _message(self) -> str:
        where = self.stage
        if self.piece_index is not None and "piece" not in where:
            where += f" (piece {self.piece_index})"
        lines = [f"Compilation failed during {where}."]
        if self.detail:
            lines.append(self.detail)
        lines.append("Workaround: run without compilation with -O0 (optimization_level=0).")
        if self.dump_dir:
            lines.append(f"What the compiler had so far is in {self.dump_dir} (see index.md).")
        else:
            lines.append("To see the graphs and passes, set a debug dump directory: "
                         "-cc.debug_dump_path=DIR (or VLLM_DEBUG_DUMP_PATH=DIR).")
        return "\n".join(lines)

    def with_dump_dir(self, dump_dir: str | None) -> CompilationStageError:
        if dump_dir and not self.dump_dir:
            self.dump_dir = dump_dir
            self.args = (self._message(),)
        return self


def graph_code(graph_or_module: Any) -> str:
    if isinstance(graph_or_module, fx.GraphModule):
        try:
            return graph_or_module.print_readable(print_output=False)
        except Exception:
            return graph_or_module.code
    if isinstance(graph_or_module, fx.Graph):
        return graph_or_module.python_code("self").src
    return str(graph_or_module)


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def dump_graph(graph_or_module: Any, path: str) -> None:
    try:
        _write(path, graph_code(graph_or_module))
    except Exception as e:  # a dump must never break compilation
        logger.warning("debug dump: could not write %s: %s", path, e)


class DebugDumper:
    """Writes the dump for one compiled model (rank directory); a no-op without a path."""

    def __init__(self, vllm_config: VllmConfig, rank: int = 0) -> None:
        base = vllm_config.compilation_config.debug_dump_path
        self.vllm_config = vllm_config
        self.dir = os.path.join(base, f"rank_{rank}") if base else None
        self._entries: dict[str, str] = {}
        self._failure: str | None = None
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.dir is not None

    def _add(self, rel: str, description: str) -> None:
        with self._lock:
            self._entries[rel] = description
        self.write_index()

    def write_text(self, rel: str, text: str, description: str) -> None:
        if not self.dir:
            return
        try:
            _write(os.path.join(self.dir, rel), text)
            self._add(rel, description)
        except Exception as e:
            logger.warning("debug dump: could not write %s: %s", rel, e)

    def dump_graph(self, rel: str, graph_or_module: Any, description: str) -> None:
        self.write_text(rel, graph_code(graph_or_module), description)

    def dump_config(self) -> None:
        try:
            data = self.vllm_config.explain_json()
        except Exception as e:
            data = {"error": f"explain_json failed: {e}"}
        self.write_text("config.json", json.dumps(data, indent=2, default=str),
                        "the resolved config, each value with its source and reason")

    def piece_dir(self, piece_index: int, tag: str) -> str | None:
        """Directory for the pass dumps of one compile of one piece (recorded in the index)."""
        if not self.dir:
            return None
        rel = f"piece_{piece_index}/{tag}"
        os.makedirs(os.path.join(self.dir, rel), exist_ok=True)
        self._add(rel + "/", f"piece {piece_index}, its compile for {tag}: the graph before "
                  "and after each pass (post_grad.<i>.<Pass>.before/after.py)")
        return os.path.join(self.dir, rel)

    def record_output_code(self, piece_index: int, tag: str, location: str) -> None:
        if not self.dir:
            return
        path = os.path.join(self.dir, "inductor_output_code.txt")
        with self._lock, open(path, "a") as f:
            f.write(f"piece {piece_index} {tag}: {location}\n")
        self._add("inductor_output_code.txt", "where Inductor wrote each piece's generated code")

    def record_failure(self, error: CompilationStageError, cause: BaseException) -> None:
        """Write the failure (message and the cause's traceback) to failure.txt and head the
        index with it: the files listed after it are what the compiler had done before."""
        if not self.dir:
            return
        import traceback

        text = str(error) + "\n\n" + "".join(
            traceback.format_exception(type(cause), cause, cause.__traceback__))
        self._failure = f"compilation FAILED during {error.stage}"
        self.write_text("failure.txt", text, "the failure: message and traceback")

    def write_index(self) -> None:
        if not self.dir:
            return
        with self._lock:
            lines = ["# Compilation debug dump", "",
                     "What the compiler saw and did, in order. Graphs are Python (FX) code.", ""]
            if self._failure:
                lines += [f"**{self._failure}**: see `failure.txt`. Entries after the failing "
                          "stage were not reached.", ""]
            lines += [f"- `{rel}`: {desc}" for rel, desc in self._entries.items()]
        _write(os.path.join(self.dir, "index.md"), "\n".join(lines) + "\n")
