"""Atomic file writes: a reader sees the old file or the whole new one, never half of it.

    atomic_write(path, text_or_bytes)
    with atomic_path(path) as tmp:      # for writers that want a path (copyfile, json, zip)
        shutil.copyfile(src, tmp)

The new content goes to a temporary file in the target's directory (same file system, so the
final `os.replace` is atomic), named uniquely per call (process id and a random part, created
exclusively), so that threads and processes writing the same path at once never share a
temporary file. The file gets the permissions a plain `open` would give (the umask's), not
mkstemp's 0600. A writer that raises leaves the target as it was and no temporary file behind.
"""
from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, fsync: bool = False) -> Iterator[str]:
    """Yield a fresh temporary path next to `path`; when the block ends normally, move it
    onto `path` (after `fsync`, for content that must survive a power cut). The target's
    directory is created if missing."""
    path = os.fspath(path)
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    while True:
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}."
                                      f"{secrets.token_hex(6)}.tmp")
        try:
            os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            break
        except FileExistsError:  # (48 random bits: practically never)
            continue
    try:
        yield tmp
        if fsync:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write(path: str | os.PathLike, data: str | bytes, *, fsync: bool = False) -> None:
    """Write `data` (text as UTF-8, or bytes) to `path` atomically (see `atomic_path`)."""
    if not isinstance(data, (str, bytes)):
        raise ValueError(f"atomic_write writes str or bytes, got {type(data).__name__}")
    with atomic_path(path, fsync=fsync) as tmp:
        if isinstance(data, str):
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(data)
        else:
            with open(tmp, "wb") as f:
                f.write(data)
