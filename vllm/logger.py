"""One logger setup for the package, with once-only helpers."""
from __future__ import annotations

import logging
import os
import sys
from functools import lru_cache

_ROOT = "vllm"
_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
_configured = False
_handler: logging.Handler | None = None


def _formatter(prefix: str = "") -> logging.Formatter:
    return logging.Formatter(prefix + _FORMAT, datefmt="%m-%d %H:%M:%S")


def _configure_root() -> None:
    global _configured, _handler
    if _configured:
        return
    _configured = True
    root = logging.getLogger(_ROOT)
    if os.environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0":
        return
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(_formatter())
    root.addHandler(_handler)
    root.setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())
    root.propagate = True


def set_process_prefix(prefix: str) -> None:
    """Start every line this process logs with `prefix`, e.g. "(TP rank=1 pid=42) ", so that
    the lines of worker processes can be told apart from each other and from rank 0's."""
    _configure_root()
    if _handler is not None:
        _handler.setFormatter(_formatter(prefix))


class VllmLogger(logging.LoggerAdapter):
    """A logger with `info_once` / `warning_once` that log a message only the first time."""

    def process(self, msg, kwargs):
        return msg, kwargs

    def info_once(self, msg: str, *args) -> None:
        if _first_time(self.logger.name, "info", msg, args):
            self.info(msg, *args, stacklevel=2)

    def warning_once(self, msg: str, *args) -> None:
        if _first_time(self.logger.name, "warning", msg, args):
            self.warning(msg, *args, stacklevel=2)


_seen: set[tuple] = set()


def _first_time(name: str, level: str, msg: str, args: tuple) -> bool:
    key = (name, level, msg, tuple(map(str, args)))
    if key in _seen:
        return False
    _seen.add(key)
    return True


@lru_cache(maxsize=None)
def init_logger(name: str) -> VllmLogger:
    """Return the package logger for module `name` (call as `init_logger(__name__)`)."""
    _configure_root()
    return VllmLogger(logging.getLogger(name), {})
