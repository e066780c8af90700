"""The compile cache through the engine, in new processes (Inductor; the starts are slow).

A second start with the same config loads every artifact and the traced graph, and runs
Dynamo and Inductor zero times; changing only the KV cache size still hits; changing a
graph-relevant option (dtype, a pass flag) is another key (a miss); a corrupt entry is
recompiled; two processes compiling the same key at once both start and produce the same
tokens. The cache lives under a tmp `VLLM_CACHE_ROOT`. (Damaged kernels, every .so of an entry:
test_graph_cache_e2e.py's test_damaged_kernels_everywhere_..., from its module's shared cold
compile.)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

try:
    from tests.compile.cache_logs import cache_dir_in, child_env, same_key_or_skip
    from tests.model_executor.hf_checkpoints import make_llama
except ImportError:  # tests/ itself on sys.path
    from compile.cache_logs import cache_dir_in, child_env, same_key_or_skip
    from model_executor.hf_checkpoints import make_llama

from vllm.compilation.cache import compute_cache_factors, compute_cache_key
from vllm.compilation.passes.pass_manager import PostGradPassManager
from vllm.engine.arg_utils import EngineArgs

NUM_PIECES = 3  # 2 attention layers: 3 compiled pieces

CHILD = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams
    from vllm.compilation.counter import compilation_counter as c
    options = json.loads(sys.argv[2])
    llm = LLM(model=sys.argv[1], max_model_len=64, max_num_batched_tokens=32, **options)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11]}, {"prompt_token_ids": [3]}],
                       SamplingParams(temperature=0.0, max_tokens=5, min_tokens=5),
                       use_tqdm=False)
    print("RESULT " + json.dumps({
        "tokens": [o.outputs[0].token_ids for o in out], "inductor": c.num_inductor_compiles,
        "hits": c.num_cache_hits, "misses": c.num_cache_misses,
        "corrupt": c.num_cache_corrupt, "graphs": c.num_graphs_seen,
        "loaded": c.num_graphs_loaded,
        "phases": llm.llm_engine.startup_phases}))
""")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return make_llama(tmp_path_factory.mktemp("cache_e2e") / "llama")


def start(tmp_path, model: str, **options) -> subprocess.Popen:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    options.setdefault("optimization_level", 2)
    return subprocess.Popen([sys.executable, str(script), model, json.dumps(options)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env(tmp_path))


def finish(proc: subprocess.Popen) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-4000:]
    line = [x for x in out.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):]), err


def key(**engine_args) -> str:
    config = EngineArgs(model="demo", optimization_level=2, **engine_args).create_engine_config()
    uuid = PostGradPassManager().configure(config).uuid()
    return compute_cache_key(compute_cache_factors(config, [], uuid))


def test_key_changes_with_the_graph_not_with_memory():
    base = key()
    assert key(kv_cache_memory="64MiB") == base
    assert key(kv_cache_memory="1GiB", num_gpu_blocks_override=100) == base
    assert key(dtype="bfloat16") != base
    assert key(compilation_config={"pass_config": {"eliminate_noops": False}}) != base
    assert key(compilation_config={"max_autotune": True}) != base


@pytest.mark.slow
def test_warm_start_in_new_processes(tmp_path, llama):
    # Two processes start at once on an empty cache: both succeed; each piece is compiled
    # once between them (the second waits on the lock, then loads).
    (a, err_a), (b, err_b) = map(finish, [start(tmp_path, llama), start(tmp_path, llama)])
    assert a["inductor"] + b["inductor"] == NUM_PIECES
    assert a["tokens"] == b["tokens"]
    assert "compile cache: miss" in err_a + err_b
    # The one that compiled traced once; the other traced too, or (when it came after the
    # first had saved the traced graph) loaded the graph instead.
    for r in (a, b):
        assert (r["graphs"], r["loaded"]) in ((1, 0), (0, 1))
        assert r["graphs"] == 1 or r["inductor"] == 0

    # Same config, other KV cache size: a hit, Inductor never runs; a pass flag changed:
    # another key, everything compiled.
    warm = start(tmp_path, llama, kv_cache_memory="32MiB")
    other = start(tmp_path, llama,
                  compilation_config={"pass_config": {"eliminate_noops": False}})
    (c, err_c), (d, err_d) = finish(warm), finish(other)
    same_key_or_skip(err_a, err_c)
    assert (c["inductor"], c["hits"], c["misses"]) == (0, NUM_PIECES, 0), err_c[-3000:]
    assert (c["graphs"], c["loaded"]) == (0, 1)  # the traced graph came from the cache too
    assert "compile cache: hit" in err_c and cache_dir_in(err_a) in err_c
    assert c["tokens"] == a["tokens"]
    # The other key uses neither the traced graph nor any piece: traced once, all compiled.
    assert cache_dir_in(err_d) != cache_dir_in(err_a)
    assert (d["hits"], d["misses"]) == (0, NUM_PIECES)
    assert (d["graphs"], d["loaded"], d["inductor"]) == (1, 0, NUM_PIECES), err_d[-3000:]
    assert d["tokens"] == a["tokens"]

    # A damaged artifact is detected, logged and recompiled; the others still load.
    directory = cache_dir_in(err_a)
    artifact = sorted(n for n in os.listdir(directory) if n.endswith(".bin"))[0]
    with open(os.path.join(directory, artifact), "r+b") as f:
        f.truncate(64)
    e, err_e = finish(start(tmp_path, llama))
    same_key_or_skip(err_a, err_e)
    assert (e["inductor"], e["hits"], e["corrupt"]) == (1, NUM_PIECES - 1, 1), err_e[-3000:]
    assert (e["graphs"], e["loaded"]) == (1, 0)  # a piece to compile: traced with Dynamo
    assert f"corrupt entry {artifact}" in err_e
    assert e["tokens"] == a["tokens"]
