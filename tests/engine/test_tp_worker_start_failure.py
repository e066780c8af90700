"""A tensor-parallel worker that dies while starting is an error at once, not a hang in the
process-group rendezvous: here the classic cause, a script without a main guard (spawned
workers import it again)."""
from __future__ import annotations

import subprocess
import sys

SCRIPT = """
from vllm import LLM
LLM(model="demo", optimization_level=0, tensor_parallel_size=2, max_model_len=128,
    kv_cache_memory="16MiB")
"""


def test_worker_dying_at_start_is_reported(tmp_path):
    script = tmp_path / "no_main_guard.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "tensor-parallel worker rank 1 exited while starting" in proc.stderr
    assert 'if __name__ == "__main__":' in proc.stderr
