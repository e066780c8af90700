"""Warm starts that skip the Dynamo trace, through the engine, in new processes (Inductor;
slow).

A cold -O2 (or -O3) start traces once and saves the traced graph next to the compiled pieces; a warm
start in a new process loads both (0 Dynamo traces, 0 Inductor compiles, every piece a cache
hit, "dynamo tracing 0.00 0" and a "graph loading" row in the start-up table) and gives the
same greedy tokens as the cold start and as -O0 under continuous batching of mixed prompt
lengths with chunked prefill. A damaged or deleted graph entry falls back to the Dynamo path
(still correct, pieces still from the cache) and is saved again. (Another graph-relevant
option is another key, graph and pieces both missed: test_cache_e2e.py.)
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

try:
    from tests.compile.cache_logs import cache_dir_in, child_env, same_key_or_skip
    from tests.model_executor.hf_checkpoints import lazy_checkpoints, make_llama
except ImportError:  # tests/ itself on sys.path
    from compile.cache_logs import cache_dir_in, child_env, same_key_or_skip
    from model_executor.hf_checkpoints import lazy_checkpoints, make_llama

from vllm.compilation.graph_cache import GRAPH_ENTRY

NUM_PIECES = 3  # 2 attention layers: 3 compiled pieces

CHILD = textwrap.dedent("""
    import json, sys
    import torch
    from vllm import LLM, SamplingParams
    from vllm.compilation.counter import compilation_counter as c


    def main():
        options = json.loads(sys.argv[2])
        llm = LLM(model=sys.argv[1], max_model_len=128, max_num_batched_tokens=24, max_num_seqs=8,
                  kv_cache_memory="16MiB", enable_prefix_caching=False, **options)
        g = torch.Generator().manual_seed(0)
        prompts = [{"prompt_token_ids": torch.randint(3, 384, (n,), generator=g).tolist()}
                   for n in [1, 5, 37, 3, 18, 9, 26, 2]]
        params = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)
                  for n in [6, 10, 4, 8, 3, 9, 5, 7]]
        out = llm.generate(prompts, params, use_tqdm=False)
        engine = llm.llm_engine
        print("RESULT " + json.dumps({
            "tokens": [o.outputs[0].token_ids for o in out], "inductor": c.num_inductor_compiles,
            "hits": c.num_cache_hits, "misses": c.num_cache_misses, "corrupt": c.num_cache_corrupt,
            "traces": c.num_graphs_seen, "loaded": c.num_graphs_loaded, "saved": c.num_graphs_saved,
            "recompiles": c.num_recompiles, "light": c.num_light_loads,
            "imported": sorted({m for m in ("torch._dynamo", "torch._inductor")
                                if m in sys.modules}),
            "phases": engine.startup_phases, "wall": engine.startup_seconds,
            "counts": {k: v["count"] for k, v in engine.startup_report["phases"].items()}}))


    if __name__ == "__main__":  # tensor parallel workers are spawned
        main()
""")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return lazy_checkpoints(tmp_path_factory.mktemp("graph_cache"))


@pytest.fixture(scope="module")
def llama_cold(tmp_path_factory, checkpoints):
    """One cold -O2 start of the llama checkpoint for the module (a cold compile is a third of
    each test's time): each test copies its cache root (`cold_copy`)."""
    base = tmp_path_factory.mktemp("llama_cold")
    cold, log = run(base, checkpoints("llama"))
    return base, cold, log


def cold_copy(tmp_path, llama_cold) -> tuple[dict, str]:
    """The module's cold start as if it had run in `tmp_path`: its cache root copied there
    (the test damages its own copy) and its log naming the copy."""
    base, cold, log = llama_cold
    shutil.copytree(base / "root", tmp_path / "root")
    return cold, log.replace(str(base / "root"), str(tmp_path / "root"))


def run(tmp_path, model: str, env: dict | None = None, **options) -> tuple[dict, str]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    options.setdefault("optimization_level", 2)
    proc = subprocess.run([sys.executable, str(script), model, json.dumps(options)],
                          capture_output=True, text=True, env=child_env(tmp_path, env), timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):]), proc.stderr


def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def assert_warm(result: dict, log: str, pieces: int = NUM_PIECES) -> None:
    """Every piece also loaded without Inductor (inductor_light.py), and neither Inductor nor
    Dynamo was imported at all (in the process of rank 0)."""
    assert (result["traces"], result["loaded"], result["inductor"]) == (0, 1, 0), log[-3000:]
    assert (result["hits"], result["misses"], result["recompiles"]) == (pieces, 0, 0)
    assert result["light"] == pieces and "hit (without Inductor)" in log, log[-3000:]
    assert result["imported"] == [], result["imported"]
    assert result["phases"]["dynamo tracing"] == 0.0 and "dynamo tracing" not in result["counts"]
    assert result["counts"]["graph loading"] == 1
    assert "Dynamo not run" in log and "compile cache: hit" in log
    table = log.split("Start-up phases", 1)[1]
    assert re.search(r"\ndynamo tracing +0\.00 +0\n", table), table
    assert "graph loading" in table and "source: compile cache, Dynamo not run" in table


@pytest.mark.slow
@pytest.mark.parametrize("model, level", [("llama", 2), ("mixtral", 3)])
def test_warm_start_skips_dynamo_and_matches_cold_and_o0(tmp_path, checkpoints, model, level,
                                                         request):
    """CPU -O3 compiles the whole graph as one piece. At -O2 and -O3 each piece's host code
    is C++ (Inductor's C++ wrapper): its one built module is what a warm start loads. (Llama
    -O2's cold start is the module's, `llama_cold`: the same child, model and options. A
    dense model piecewise and an MoE one whole; other families' compiled graphs against
    transformers: tests/engine/test_model_families_e2e.py.)"""
    path = checkpoints(model)
    pieces = 1 if level == 3 else NUM_PIECES
    eager, _ = run(tmp_path, path, optimization_level=0)
    if (model, level) == ("llama", 2):
        cold, cold_log = cold_copy(tmp_path, request.getfixturevalue("llama_cold"))
    else:
        cold, cold_log = run(tmp_path, path, optimization_level=level)
    assert (cold["traces"], cold["loaded"], cold["saved"]) == (1, 0, 1), cold_log[-3000:]
    assert cold["inductor"] == pieces and cold["counts"]["dynamo tracing"] == 1
    directory = cache_dir_in(cold_log)
    assert directory.endswith("rank_0") and os.path.isfile(os.path.join(directory, GRAPH_ENTRY))
    # On the CPU -O2/-O3 compile with Inductor's C++ wrapper: each piece is one built module
    # (its host code and kernels).
    entries = _light_entries(directory)
    assert entries and all([k["module"].split(".")[-1] for k in e["kernels"]]
                           == ["inductor_entry_cpp"] for e in entries), entries

    warm, warm_log = run(tmp_path, path, optimization_level=level)
    same_key_or_skip(cold_log, warm_log)
    assert_warm(warm, warm_log, pieces)
    assert warm["tokens"] == cold["tokens"] == eager["tokens"]


@pytest.mark.slow
def test_tensor_parallel_ranks_keep_their_own_graphs(tmp_path, checkpoints):
    """Each rank's traced graph has constants of its own (e.g. its vocabulary shard's
    offset): every rank saves and loads its own entry (rank_<r>/), and a warm TP=2 start
    generates what the cold one and -O0 do. A one-layer Llama: two pieces per rank (each
    TP piece's C++ module, which calls the all-reduce op through the dispatcher, takes
    several times a TP=1 piece's build), not three."""
    path = make_llama(tmp_path / "llama_1_layer", num_hidden_layers=1)
    eager, _ = run(tmp_path, path, optimization_level=0, tensor_parallel_size=2)
    cold, cold_log = run(tmp_path, path, tensor_parallel_size=2)
    directory = cache_dir_in(cold_log)
    for rank in (0, 1):
        entry = os.path.join(os.path.dirname(directory), f"rank_{rank}", GRAPH_ENTRY)
        assert os.path.isfile(entry), cold_log[-3000:]
    warm, warm_log = run(tmp_path, path, tensor_parallel_size=2)
    same_key_or_skip(cold_log, warm_log)
    assert_warm(warm, warm_log, pieces=2)
    assert warm["tokens"] == cold["tokens"] == eager["tokens"]


@pytest.mark.slow
def test_damaged_or_deleted_graph_falls_back_to_dynamo(tmp_path, checkpoints, llama_cold):
    path = checkpoints("llama")
    cold, cold_log = cold_copy(tmp_path, llama_cold)
    graph = os.path.join(cache_dir_in(cold_log), GRAPH_ENTRY)

    # One byte flipped: the checksum catches it; Dynamo traces, the pieces still load, and
    # the graph is saved again for the next start.
    flip_byte(graph, 100)
    damaged, log = run(tmp_path, path)
    same_key_or_skip(cold_log, log)
    assert (damaged["traces"], damaged["loaded"], damaged["corrupt"]) == (1, 0, 1), log[-3000:]
    assert (damaged["inductor"], damaged["hits"], damaged["saved"]) == (0, NUM_PIECES, 1)
    assert f"corrupt entry {GRAPH_ENTRY}" in log and "traced graph not used" in log
    assert damaged["tokens"] == cold["tokens"]

    warm, log = run(tmp_path, path)
    same_key_or_skip(cold_log, log)
    assert_warm(warm, log)
    assert warm["tokens"] == cold["tokens"]

    os.unlink(graph)
    deleted, log = run(tmp_path, path)
    same_key_or_skip(cold_log, log)
    assert (deleted["traces"], deleted["loaded"], deleted["inductor"]) == (1, 0, 0), log[-3000:]
    assert f"{GRAPH_ENTRY} is missing or damaged" in log
    assert deleted["tokens"] == cold["tokens"]


def _light_entries(directory: str) -> list[dict]:
    entries = []
    for name in sorted(os.listdir(directory)):
        if name.endswith(".light.json"):
            with open(os.path.join(directory, name)) as f:
                entries.append(json.load(f))
    return entries


@pytest.mark.slow
def test_a_damaged_light_kernel_is_caught_and_the_next_start_runs_without_inductor(
        tmp_path, checkpoints, llama_cold):
    """The cold start describes every piece for loading without Inductor, its kernels copied
    under their checksums. A copy damaged on disk is caught before it is loaded: counted,
    the pieces using it load the full way (the same tokens), and are described again, so
    the start after that runs without Inductor again."""
    path = checkpoints("llama")
    cold, cold_log = cold_copy(tmp_path, llama_cold)
    directory = cache_dir_in(cold_log)
    entries = _light_entries(directory)
    assert len(entries) == NUM_PIECES, cold_log[-3000:]
    kernel = entries[1]["kernels"][0]["file"]
    users = sum(any(k["file"] == kernel for k in e["kernels"]) for e in entries)
    flip_byte(os.path.join(directory, "light_kernels", kernel), 200)

    damaged, log = run(tmp_path, path)
    same_key_or_skip(cold_log, log)
    assert "is damaged (size or checksum)" in log, log[-3000:]
    # (A later piece using the same kernel finds it repaired: the first one's full load
    # copied Inductor's build again.)
    assert 1 <= damaged["corrupt"] <= users
    assert damaged["light"] == NUM_PIECES - damaged["corrupt"]
    assert (damaged["traces"], damaged["inductor"]) == (0, 0)
    assert damaged["tokens"] == cold["tokens"]

    warm, log = run(tmp_path, path)
    assert_warm(warm, log)
    assert warm["tokens"] == cold["tokens"]


@pytest.mark.slow
def test_damaged_kernels_everywhere_fall_back_and_the_table_still_adds_up(tmp_path, checkpoints,
                                                                          llama_cold):
    """Every light kernel and every kernel Inductor built, damaged: the copies the light
    entries load (checksummed: caught, counted, the pieces load the full way) and the ones
    Inductor built (a .so in the entry's Inductor cache, which our checksums do not cover).
    The warm start's graph load fails at the first piece, Dynamo traces, that piece is
    recompiled from an emptied Inductor cache (it would otherwise reuse the damaged file) and
    the rest load; the next start hits every piece. The start-up table counts the failed
    attempt once: its phases add up to the wall time (the failed graph load used to include
    the piece rows, 10-13% over), and the piece whose load failed is no "hit".
    (Moved here from test_cache_e2e.py, which compiled a cache of its own for it.)"""
    path = checkpoints("llama")
    cold, cold_log = cold_copy(tmp_path, llama_cold)
    directory = cache_dir_in(cold_log)
    light = os.listdir(os.path.join(directory, "light_kernels"))
    assert light and all(name.endswith(".so") for name in light), light
    for name in light:
        open(os.path.join(directory, "light_kernels", name), "w").close()
    built = [os.path.join(root, name)
             for root, _, files in os.walk(os.path.join(directory, "inductor_cache"))
             for name in files if name.endswith(".so")]
    assert built
    for name in built:
        os.truncate(name, 100)

    damaged, log = run(tmp_path, path)
    same_key_or_skip(cold_log, log)
    assert damaged["tokens"] == cold["tokens"]
    assert damaged["traces"] == 1 and damaged["loaded"] == 0, log[-3000:]
    assert damaged["hits"] + damaged["misses"] == NUM_PIECES and damaged["misses"] >= 1
    assert damaged["corrupt"] >= 1 and "emptying" in log, log[-3000:]
    phases = {k: v for k, v in damaged["phases"].items() if k != "other"}
    assert sum(phases.values()) <= 1.05 * damaged["wall"], (phases, damaged["wall"])
    table = log.split("Start-up phases", 1)[1]
    assert "load failed" in table, table
    rows = re.findall(r"\n  piece \d+ .*cache: ([^;\n]*)", table)
    assert sum(r.split(", ").count("hit") for r in rows) == damaged["hits"], table

    # The start after that: every piece a hit, Inductor never runs, nothing corrupt.
    warm, log = run(tmp_path, path)
    same_key_or_skip(cold_log, log)
    assert (warm["inductor"], warm["hits"], warm["corrupt"]) == (0, NUM_PIECES, 0), log[-3000:]
    assert warm["tokens"] == cold["tokens"]
