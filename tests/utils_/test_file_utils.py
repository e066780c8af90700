"""atomic_write / atomic_path: whole content or the old file, never half; one helper."""
from __future__ import annotations

import os
import re
import stat
import threading
from pathlib import Path

import pytest

from vllm.utils.file_utils import atomic_path, atomic_write

PACKAGE = Path(__file__).resolve().parents[2] / "vllm"
# (The compile cache's warm-start copies moved to the helper with issue 20's fold.)
NOT_YET_MOVED: set[str] = set()


def test_writes_text_and_bytes_and_creates_the_directory(tmp_path):
    target = tmp_path / "new" / "dir" / "f.txt"
    atomic_write(target, "héllo")
    assert target.read_text(encoding="utf-8") == "héllo"
    atomic_write(target, b"\x00\x01", fsync=True)
    assert target.read_bytes() == b"\x00\x01"
    assert os.listdir(target.parent) == ["f.txt"]


def test_bad_data_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="str or bytes, got dict"):
        atomic_write(tmp_path / "f", {"a": 1})


def test_a_failed_writer_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "f.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        Path(tmp).write_text("half")
        raise RuntimeError("writer died")
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["f.json"]


def test_permissions_follow_the_umask_not_0600(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write(tmp_path / "f", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "f").stat().st_mode) == 0o644


def test_threads_writing_one_path_never_share_a_temporary(tmp_path):
    """With a per-process temporary name ("path.<pid>.tmp") two threads of one process
    write into the same temporary file and one os.replace fails or mixes contents."""
    target = tmp_path / "shared"
    payloads = [bytes([i]) * 200_000 for i in range(8)]
    errors: list[BaseException] = []
    start = threading.Barrier(len(payloads))

    def writer(data: bytes) -> None:
        try:
            start.wait()
            for _ in range(20):
                atomic_write(target, data)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(p,)) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert target.read_bytes() in payloads
    assert os.listdir(tmp_path) == ["shared"]


def test_one_atomic_write_helper_in_the_package():
    """Every `os.replace` of a freshly written file goes through vllm/utils/file_utils.py."""
    users = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                   if re.search(r"\bos\.replace\(", p.read_text()))
    assert set(users) - NOT_YET_MOVED == {"utils/file_utils.py"}, users
