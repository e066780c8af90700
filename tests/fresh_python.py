"""Run a snippet in a new Python process: for what depends on what a process has imported."""
from __future__ import annotations

import subprocess
import sys


def run_fresh(code: str, cwd) -> str:
    """Run `code` with this interpreter in a new process started in `cwd`; its stdout. The
    calling test fails with the process's stderr when it exits non-zero."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, cwd=cwd)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout
