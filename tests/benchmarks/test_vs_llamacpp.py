"""benchmarks/bench_vs_llamacpp.py and benchmarks/gguf_convert.py: the GGUF a tiny checkpoint
converts to gives llama.cpp transformers' logits and greedy tokens (skipped without
llama-cpp-python / gguf: `pip install -e '.[bench]'`), and the report renders."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

try:
    from tests.model_executor.hf_checkpoints import make_llama, make_qwen2
except ImportError:  # tests/ itself on sys.path
    from model_executor.hf_checkpoints import make_llama, make_qwen2

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks")
SCRIPT = os.path.join(BENCH, "bench_vs_llamacpp.py")
sys.path.insert(0, BENCH)

import bench_vs_llamacpp as bench  # noqa: E402

PROMPT_LEN, NEW_TOKENS = 32, 4


def hf_reference(path: str, dtype: torch.dtype) -> tuple[np.ndarray, list[list[int]]]:
    """transformers' logits at the last position of the first prompt and its greedy tokens
    for each of the 16 prompts."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # plain greedy: EOS neither ends nor is masked
    ids = torch.tensor(bench.prompt_ids(16, PROMPT_LEN, model.config.vocab_size))
    with torch.inference_mode():
        logits = model(ids[:1]).logits[0, -1].float().numpy()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=NEW_TOKENS, pad_token_id=0)
    return logits, out[:, PROMPT_LEN:].tolist()


def run_llamacpp_worker(path: str, gguf_path: str, logits_out: str, kv: str) -> dict:
    cmd = [sys.executable, SCRIPT, "--worker", "llamacpp", "--path", path, "--gguf", gguf_path,
           "--threads", "1", "--prompt-len", str(PROMPT_LEN), "--max-tokens", str(NEW_TOKENS),
           "--batch16", "16", "--b16-prompt-len", str(PROMPT_LEN), "--b16-max-tokens",
           str(NEW_TOKENS),
           "--logits-out", logits_out, "--llamacpp-kv", kv,
           "--llamacpp-flash-attn", "off"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith(bench._RESULT)][-1]
    return json.loads(line[len(bench._RESULT):])


def make_qwen2_tied(path):
    return make_qwen2(path, tie_word_embeddings=True)  # as Qwen2.5-0.5B: no output.weight


@pytest.mark.parametrize("make", [make_llama, make_qwen2, make_qwen2_tied],
                         ids=["llama", "qwen2", "qwen2-tied"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gguf_round_trip_matches_transformers(tmp_path, make, dtype):
    pytest.importorskip("gguf")
    pytest.importorskip("llama_cpp")
    from gguf_convert import convert

    # GQA (4 heads, 2 KV heads) exercises the per-KV-head reordering of k_proj's rows
    path = make(tmp_path / "ckpt")
    if dtype == "bfloat16":
        path = bench.write_bf16_copy(path, str(tmp_path / "ckpt-bf16"))
    gguf_path = convert(path, str(tmp_path / "m.gguf"), dtype)
    # the KV cache in the model's dtype and no flash attention (llama.cpp's defaults, float16
    # KV and flash attention on the CPU, round to float16): the same math
    kv = {"float32": "f32", "bfloat16": "bf16"}[dtype]
    result = run_llamacpp_worker(path, gguf_path, str(tmp_path / "logits.npy"), kv)
    logits = np.load(tmp_path / "logits.npy")
    ref_logits, ref_tokens = hf_reference(path, getattr(torch, dtype))
    assert logits.shape == ref_logits.shape
    if dtype == "float32":  # same weights, same math: float32 rounding only
        np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=1e-4 * np.abs(
            ref_logits).max() + 1e-5)
        # batch 1 and each of the 16 sequences of one llama_batch: transformers' tokens
        assert result["b1"]["tokens"] == ref_tokens[0]
        assert result["b16"]["tokens"] == ref_tokens[0]
        assert result["b16"]["tokens_last"] == ref_tokens[-1] != ref_tokens[0]
    else:  # bfloat16 activations differ in rounding between the engines
        err = np.abs(logits - ref_logits).max() / np.abs(ref_logits).max()
        assert err < 0.05, err
    assert result["b1"]["decode_tok_s"] > 0 and result["b16"]["total_tok_s"] > 0


def test_gguf_tokenizer_matches_the_checkpoints(tmp_path):
    pytest.importorskip("gguf")
    llama_cpp = pytest.importorskip("llama_cpp")
    from gguf_convert import convert
    from transformers import AutoTokenizer

    path = make_llama(tmp_path / "ckpt")
    gguf_path = convert(path, str(tmp_path / "m.gguf"))
    vocab_only = llama_cpp.Llama(gguf_path, vocab_only=True, verbose=False)
    hf = AutoTokenizer.from_pretrained(path)
    for text in ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return 42",
                 "Hello world! How are you today?"]:
        ours = vocab_only.tokenize(text.encode(), add_bos=False, special=False)
        assert ours == hf(text, add_special_tokens=False)["input_ids"], text
    assert vocab_only.token_eos() == hf.eos_token_id
    assert vocab_only.n_vocab() == 384


def test_convert_rejects_unsupported_architectures(tmp_path):
    pytest.importorskip("gguf")
    from gguf_convert import convert

    path = make_llama(tmp_path / "ckpt", tokenizer=False)
    config = json.load(open(os.path.join(path, "config.json")))
    config["architectures"] = ["GPT2LMHeadModel"]
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        convert(path, str(tmp_path / "m.gguf"))
    with pytest.raises(ValueError, match="float16"):
        convert(path, str(tmp_path / "m.gguf"), "float16")


def test_report_has_ratios_bandwidth_share_and_failures():
    args = SimpleNamespace(engines=list(bench.ENGINES), batch16_shapes=["llama-50m"],
                           llamacpp_kv="f16", llamacpp_flash_attn="auto",
                           threads=2, rounds=3, prompt_len=32, max_tokens=128,
                           b16_prompt_len=128, b16_max_tokens=128, isa="native",
                           long_prompt_shapes=["llama-50m"], long_prompt_len=1024)
    cases = {("llama-50m", "float32"): {"weight_bytes": 100_000_000}}

    def run(b1: float, b16: float, rss: float = 1000.0) -> dict:
        return {"b1": {"decode_tok_s": b1, "tokens": [1, 2, 3]}, "b16": {"total_tok_s": b16},
                "long": {"prefill_tok_s": b16 * 4}, "peak_rss_mb": rss, "anon_rss_mb": rss / 2}

    runs = {("llama-50m", "float32", "hf"): [run(10, 50)] * 3,
            ("llama-50m", "float32", "llamacpp"): [run(80, 200, 400), run(100, 300, 420),
                                                   run(90, 250, 410)],
            ("llama-50m", "float32", "O0"): [run(40, 100)] * 3,
            ("llama-50m", "float32", "O2"): [run(45, 500), {"error": "exit 1: boom"},
                                             run(45, 500)],
            ("llama-50m", "float32", "O3"): [run(50, 400)] * 3}
    machine = {"cpu": "test cpu", "isa": "AVX2 + FMA", "flags": ["avx2", "fma"],
               "logical_cpus": 2}
    summary = bench.summarize(args, cases, runs, [20.0, 10.0, 30.0], machine,
                              {"version": "0", "system_info": "AVX2 = 1"},
                              {("llama-50m", "float32"): [1, 2, 9]})
    b1, b16, long = summary["rows"]
    assert b1["engines"]["llamacpp"]["tok_s"] == 90  # the median of the rounds
    assert b1["engines"]["O2"]["vs_llamacpp"] == pytest.approx(0.5)
    assert b16["engines"]["O2"]["vs_llamacpp"] == pytest.approx(2.0)
    assert long["workload"] == "long" and long["engines"]["llamacpp"]["tok_s"] == 1000
    assert long["engines"]["O2"]["vs_llamacpp"] == pytest.approx(2.0)
    # 100 MB x 90 tok/s = 9 GB/s of the best bandwidth reading, 30 GB/s
    assert b1["engines"]["llamacpp"]["pct_of_bandwidth"] == pytest.approx(30.0)
    assert b1["engines"]["O2"]["errors"] == ["exit 1: boom"]
    text = bench.markdown(summary)
    assert "ISA AVX2 + FMA" in text and "read bandwidth 30.0 GB/s" in text
    assert "| 0.50x |" in text and "| 2.00x |" in text
    assert "| 1024-token prompt prefill tok/s | 200.00 | 1000.00 | 400.00 | 2000.00 |" in text
    assert "one 1024-token prompt, prefill tok/s" in text
    assert "9.00 (30%)" in text and text.count("ours -O2: exit 1: boom") == 1
    # peak and end-of-run RSS: the median over the rounds that ran (the failed one has none)
    assert b1["engines"]["llamacpp"]["peak_rss_mb"] == 410
    assert b1["engines"]["llamacpp"]["anon_rss_mb"] == 205
    assert b16["engines"]["O2"]["peak_rss_mb"] == 1000
    assert "Resident memory" in text
    assert ("| 50M Llama (hidden 512, 8 layers, vocab 32000) | float32 | 1000 / 500 | 410 / 205 "
            "| 1000 / 500 |") in text
    # greedy check: the leading tokens equal to transformers' [1, 2, 3], per engine
    check = summary["greedy_check"][0]
    assert check["leading_match"] == {"hf": 3, "llamacpp": 3, "O0": 3, "O2": 3, "O3": 3,
                                      bench.EXACT: 2}
    assert "| transformers eager | 3 | 3 | 3 | 3 | 3 | 2 |" in text


def test_the_16bit_kv_engine_gets_its_cache_and_its_own_ratio(monkeypatch):
    """`--engines ... O2-kv16`: -O2 with kv_cache_dtype="float16" under float32 weights (a
    bfloat16 model keeps its bfloat16 cache), and a ratio column of its own in the report."""
    made = []

    def fake_llm(**kwargs):
        made.append(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(bench, "steady_llm", fake_llm)
    for dtype, expected in (("float32", "float16"), ("bfloat16", "auto")):
        args = SimpleNamespace(worker=bench.KV16, path="p", dtype=dtype, prompt_len=32,
                               max_tokens=128, b16_prompt_len=128, b16_max_tokens=128,
                               long_prompt=0, batch16=16)
        with pytest.raises(RuntimeError, match="stop here"):
            bench.run_ours(args)
        assert made[-1]["kv_cache_dtype"] == expected
        assert made[-1]["optimization_level"] == 2
    args.worker = "O3"
    with pytest.raises(RuntimeError, match="stop here"):
        bench.run_ours(args)
    assert made[-1]["kv_cache_dtype"] == "auto" and made[-1]["optimization_level"] == 3

    args = SimpleNamespace(engines=["llamacpp", "O2", bench.KV16], batch16_shapes=["llama-50m"],
                           llamacpp_kv="f16", llamacpp_flash_attn="auto", threads=2, rounds=1,
                           prompt_len=32, max_tokens=128, b16_prompt_len=128,
                           b16_max_tokens=128, isa="native", long_prompt_shapes=[],
                           long_prompt_len=1024)
    runs = {("llama-50m", "float32", e): [{"b1": {"decode_tok_s": b1, "tokens": [1]},
                                           "b16": {"total_tok_s": b16}}]
            for e, b1, b16 in (("llamacpp", 100, 400), ("O2", 110, 580),
                               (bench.KV16, 112, 640))}
    machine = {"cpu": "c", "isa": "AVX-512", "flags": [], "logical_cpus": 2}
    summary = bench.summarize(args, {("llama-50m", "float32"): {"weight_bytes": 10}}, runs,
                              [30.0], machine, {"version": "0", "system_info": ""})
    text = bench.markdown(summary)
    assert "| -O2 / llama.cpp | -O2 16-bit KV / llama.cpp |" in text
    assert "| 100.00 | 110.00 | 112.00 | 1.10x | 1.12x |" in text
    assert "| 400.00 | 580.00 | 640.00 | 1.45x | 1.60x |" in text
    assert 'kv_cache_dtype="float16" under float32 weights' in text


def test_isa_avx2_limits_every_library_and_needs_an_avx2_llamacpp(monkeypatch):
    from vllm.utils.cpu_info import supported_isa_levels

    if "avx2" not in supported_isa_levels():
        pytest.skip("this CPU cannot run AVX2 code")
    for name in bench.AVX2_ENV:
        monkeypatch.setenv(name, "")  # restored after the test
    args = SimpleNamespace(engines=["llamacpp", "O2"])
    monkeypatch.delenv("LLAMA_CPP_LIB_PATH", raising=False)
    with pytest.raises(SystemExit, match="LLAMA_CPP_LIB_PATH.*build_llamacpp.sh avx2"):
        bench.limit_isa(args)
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", "/somewhere")
    bench.limit_isa(args)
    assert {k: os.environ[k] for k in bench.AVX2_ENV} == bench.AVX2_ENV
    # The variables are the ones torch and our kernels read: a process with them runs AVX2.
    probe = ("import torch; from vllm.utils.cpu_info import cpu_isa_level; "
             "print(torch.backends.cpu.get_cpu_capability(), cpu_isa_level())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["AVX2", "avx2"]


def test_report_says_when_it_ran_as_avx2():
    summary = {"machine": {"cpu": "c", "isa": "AVX-512", "flags": [], "logical_cpus": 2,
                           "our_kernels": "avx2"},
               "bandwidth_gb_s": {"best": 10.0, "readings": [10.0]},
               "llama_cpp": {"version": "0", "system_info": "AVX2 = 1"}, "threads": 2,
               "rounds": 1, "prompt_len": 32, "max_tokens": 128,
               "batch16": {"prompt_len": 128, "max_tokens": 128}, "engines": ["llamacpp", "O2"],
               "rows": [], "greedy_check": []}
    assert "AVX2-only" not in bench.markdown({**summary, "isa": "native"})
    text = bench.markdown({**summary, "isa": "avx2"})
    assert "Run as on an AVX2-only CPU" in text and "ONEDNN_MAX_CPU_ISA=AVX2" in text


def test_peak_rss_is_the_workers_own_not_its_forked_parents():
    """A worker started by a process holding ~400 MB reports its own peak, not the parent's
    (getrusage's ru_maxrss carries the parent's over fork + exec)."""
    code = ("import os, subprocess, sys\n"
            "held = bytearray(400 << 20)\n"
            "held[::4096] = b'x' * len(held[::4096])  # resident\n"
            "child = ('import sys; sys.path.insert(0, sys.argv[1]); '\n"
            "         'import bench_vs_llamacpp as b; print(b.peak_rss_mb())')\n"
            "print(subprocess.run([sys.executable, '-c', child, sys.argv[1]],\n"
            "                     capture_output=True, text=True, check=True).stdout)\n")
    out = subprocess.run([sys.executable, "-c", code, BENCH], capture_output=True, text=True,
                         check=True).stdout
    assert 5 < float(out.strip()) < 300, out
