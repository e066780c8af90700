"""-O0 is the fast start: its engine never imports the compile backend (torch._dynamo,
torch._inductor and our pass manager: ~0.5 s), and a start that finds the CPU kernels already
built does not import torch's C++ build tooling (~0.1 s)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import json, sys
from vllm import LLM
LLM(model="demo", optimization_level=0, kv_cache_memory="16MiB")
print(json.dumps({name: name in sys.modules for name in (
    "vllm.compilation.backends", "vllm.compilation.passes.pass_manager", "torch._inductor",
    "torch._dynamo", "torch.utils.cpp_extension")}))
"""


@pytest.mark.slow
def test_o0_start_imports_no_compiler(tmp_path):
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path)}
    runs = []
    for _ in range(2):  # the first may build the CPU kernels; the second finds them
        proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                              env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert not any(runs[1].values()), runs[1]
