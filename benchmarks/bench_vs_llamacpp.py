"""Our engine against llama.cpp (through llama-cpp-python) on the same weights, side by side.

For each shape (the 50M Llama and the Qwen2.5-0.5B shape of benchmarks/checkpoints.py, random
weights) and each dtype (float32, bfloat16), a Hugging Face checkpoint is written and converted
to GGUF (benchmarks/gguf_convert.py), and five engines are measured, each case in a fresh
process, the engines taking turns round after round (the order rotates each round) so that
they see the same machine state; every figure is the median over the rounds:

- transformers (PyTorch eager, its default attention) `generate`;
- llama.cpp through llama-cpp-python's C API: one context, `n_threads` = ours, `n_batch`
  sized for the whole prompt, llama.cpp's default flash-attention setting, greedy sampler;
- ours at -O0, -O2, -O3 (`vllm.LLM(optimization_level=...)`, weights prepacked before timing);
  on request (`--engines ... O2-kv16`) also -O2 with a 16-bit KV cache, llama.cpp's default
  cache precision (kv_cache_dtype="float16" under float32 weights).

Workloads: batch-1 decode tokens/s (128 new tokens after a 32-token prompt, greedy, EOS
ignored; (tokens - 1) over first output token to last), and batch 16 x 128-token prompts,
total output tokens/s with the prefill included (llama.cpp: the 16 sequences share one
llama_batch, n_seq_max=16, prefilled together, then one token per sequence per decode call);
with --long-prompt-shapes, also the prefill of one --long-prompt-len-token prompt (default
1024), prompt tokens over the time to the first output token (the second of two runs).
The machine's read bandwidth is measured in the same run (a >1 GiB float32 sum and gemv with
the same thread count, best of 5 each, once per round; the best reading counts); batch-1
decode is also given as the weight-read rate (weight bytes read per token x tokens/s) in % of
that bandwidth.
The first greedy tokens of every engine are checked against transformers' (a sanity check of
the GGUF conversion), and for float32 those of llama.cpp at the same math (float32 KV cache,
no flash attention; its defaults round both to float16).
llama.cpp's KV-cache type and flash attention: --llamacpp-kv, --llamacpp-flash-attn.

    pip install -e '.[bench]'
    python benchmarks/bench_vs_llamacpp.py            # full run (see --help), results/vs_llamacpp.*
    python benchmarks/bench_vs_llamacpp.py --quick    # smoke run, results/vs_llamacpp_quick.*

As on an AVX2-only CPU, on a machine with AVX-512 (`--isa avx2`): every library of ours runs
its AVX2 code (our C++ kernels VLLM_CPU_ISA, ATen and Inductor ATEN_CPU_CAPABILITY, oneDNN
ONEDNN_MAX_CPU_ISA, MKL MKL_ENABLE_INSTRUCTIONS, set for every worker), and llama.cpp is an
AVX2 build of the same version, whose libraries LLAMA_CPP_LIB_PATH names (a run whose llama.cpp
reports AVX-512 stops):

    bash benchmarks/build_llamacpp.sh avx2
    LLAMA_CPP_LIB_PATH=benchmarks/results/tmp/llamacpp-avx2/build/bin \
        python benchmarks/bench_vs_llamacpp.py --isa avx2 \
        --out benchmarks/results/vs_llamacpp_as_avx2
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))  # this checkout's vllm, installed or not
from process_memory import anon_rss_mb, peak_rss_mb  # noqa: E402

_RESULT = "VS_LLAMACPP_RESULT "
ENGINES = ("hf", "llamacpp", "O0", "O2", "O3")
# Not run by default: ours at -O2 with a 16-bit KV cache, llama.cpp's default cache precision
# (kv_cache_dtype="float16" under a float32 model; a bfloat16 model's cache is 16-bit anyway).
KV16 = "O2-kv16"
LABELS = {"hf": "transformers eager", "llamacpp": "llama.cpp", "O0": "ours -O0",
          "O2": "ours -O2", "O3": "ours -O3", KV16: "ours -O2, 16-bit KV"}
RATIO_ENGINES = {"O2": "-O2 / llama.cpp", KV16: "-O2 16-bit KV / llama.cpp"}
EXACT = "llamacpp_exact"  # llama.cpp with a float32 KV cache and no flash attention
LABELS[EXACT] = "llama.cpp, f32 KV, no flash attn"
SHAPE_LABELS = {"llama-50m": "50M Llama (hidden 512, 8 layers, vocab 32000)",
                "qwen2.5-0.5b": "Qwen2.5-0.5B shape"}
CHECK_TOKENS = 8  # leading greedy tokens compared across engines
# each workload's figure in a worker's result
WORKLOAD_KEYS = {"b1": "decode_tok_s", "b16": "total_tok_s", "long": "prefill_tok_s"}
GGML_TYPES = {"f32": 0, "f16": 1, "bf16": 30}  # ggml.h's enum ggml_type
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # llama.h's enum llama_flash_attn_type


def prompt_ids(batch: int, length: int, vocab: int) -> list[list[int]]:
    """Deterministic prompts of `length` token ids each."""
    return [[(7 * i + 13 * j) % (vocab - 10) + 5 for j in range(length)] for i in range(batch)]


# ---------------------------------------------------------------------------------------------
# workers (each runs in a fresh process and prints one RESULT line)


def run_hf(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.path, dtype=getattr(torch, args.dtype))
    model.eval()
    # EOS neither ends nor is suppressed (min_new_tokens would mask it): plain greedy, as
    # ignore_eos and llama.cpp's loop give
    model.generation_config.eos_token_id = None
    vocab = model.config.vocab_size

    class FirstToken:
        """A generate() streamer noting when the first new tokens arrive (its first put() is
        the prompt)."""

        def __init__(self) -> None:
            self.puts, self.first = 0, None

        def put(self, value) -> None:
            self.puts += 1
            if self.puts == 2:
                self.first = time.perf_counter()

        def end(self) -> None:
            pass

    def timed(batch: int, length: int, n: int) -> dict:
        ids = torch.tensor(prompt_ids(batch, length, vocab))
        streamer = FirstToken()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 do_sample=False, pad_token_id=0, streamer=streamer)
        end = time.perf_counter()
        assert out.shape == (batch, length + n), out.shape
        return {"start": start, "first": streamer.first, "end": end,
                "tokens": out[0, length:].tolist(), "tokens_last": out[-1, length:].tolist()}

    return measure(args, timed)


def steady_llm(**kwargs):
    """`vllm.LLM(**kwargs)` with its weight prepacking finished (-O2/-O3 on the CPU prepack in
    the background after ready): what steady-state timings start from."""
    from vllm import LLM

    llm = LLM(**kwargs)
    try:
        from vllm.model_executor.layers.cpu_prepacked_linear import wait_for_prepacking

        wait_for_prepacking()
    except ImportError:
        pass
    return llm


def run_ours(args) -> dict:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kv16 = args.worker == KV16 and args.dtype == "float32"
    llm = steady_llm(model=args.path, dtype=args.dtype, optimization_level=int(args.worker[1]),
                     kv_cache_dtype="float16" if kv16 else "auto",
                     max_model_len=max(512, args.prompt_len + args.max_tokens,
                                       args.b16_prompt_len + args.b16_max_tokens,
                                       args.long_prompt + 1),
                     kv_cache_memory="2GiB", max_num_seqs=max(16, args.batch16))
    engine = llm.llm_engine
    vocab = engine.vllm_config.model_config.get_vocab_size()
    counter = iter(range(1 << 30))

    def timed(batch: int, length: int, n: int) -> dict:
        # FINAL_ONLY, as LLM.generate asks; the scheduler tells when every request has its
        # first token.
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        engine.reset_prefix_cache()  # the same prefill work every time, not cache hits
        ids = [f"vs-{next(counter)}" for _ in range(batch)]
        start = time.perf_counter()
        for request_id, p in zip(ids, prompt_ids(batch, length, vocab)):
            engine.add_request(request_id, {"prompt_token_ids": p}, params)
        scheduled = engine.scheduler.requests
        first, done = None, {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            if first is None and all(r in done or scheduled[r].num_output_tokens > 0
                                     for r in ids):
                first = time.perf_counter()
        end = time.perf_counter()
        assert len(done) == batch and all(len(o.outputs[0].token_ids) == n
                                          for o in done.values())
        return {"start": start, "first": first, "end": end,
                "tokens": list(done[ids[0]].outputs[0].token_ids),
                "tokens_last": list(done[ids[-1]].outputs[0].token_ids)}

    return measure(args, timed)


def run_llamacpp(args) -> dict:
    import llama_cpp as lc
    import numpy as np

    lc.llama_backend_init()
    mparams = lc.llama_model_default_params()
    model = lc.llama_model_load_from_file(args.gguf.encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {args.gguf}")
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    contexts: dict[int, tuple] = {}

    def context(n_seq: int, length: int, n: int) -> tuple:
        """A context (and batch) for n_seq sequences of `length` + `n` tokens, made once per
        workload: n_batch holds the whole prompt, n_seq_max = n_seq."""
        if (n_seq, length) not in contexts:
            cparams = lc.llama_context_default_params()
            cparams.n_ctx = n_seq * (length + n + 64)
            cparams.n_batch = n_seq * length
            cparams.n_ubatch = min(cparams.n_batch, 512)
            cparams.n_seq_max = n_seq
            cparams.n_threads = cparams.n_threads_batch = args.threads
            cparams.type_k = cparams.type_v = GGML_TYPES[args.llamacpp_kv]
            cparams.flash_attn_type = FLASH_ATTN[args.llamacpp_flash_attn]
            cparams.no_perf = True
            ctx = lc.llama_init_from_model(model, cparams)
            if not ctx:
                raise RuntimeError(f"llama.cpp could not create a context for {n_seq} sequences")
            contexts[(n_seq, length)] = (
                ctx, lc.llama_batch_init(max(cparams.n_batch, n_seq), 0, 1), cparams)
        return contexts[(n_seq, length)]

    sampler = lc.llama_sampler_init_greedy()

    def decode(ctx, batch, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries."""
        for i, (tok, pos, seq, logits) in enumerate(entries):
            batch.token[i] = tok
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = logits
        batch.n_tokens = len(entries)
        rc = lc.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def timed(nseq: int, length: int, n: int) -> dict:
        ctx, batch, _ = context(nseq, length, max(n, args.max_tokens, args.b16_max_tokens))
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        prompts = prompt_ids(nseq, length, vocab)
        start = time.perf_counter()
        decode(ctx, batch, [(t, j, s, j == length - 1) for s, p in enumerate(prompts)
                for j, t in enumerate(p)])
        # sampled by batch index: sequence s's last prompt token is entry s * length + length - 1
        last = [lc.llama_sampler_sample(sampler, ctx, s * length + length - 1)
                for s in range(nseq)]
        first = time.perf_counter()
        out = [[t] for t in last]
        for step in range(1, n):
            decode(ctx, batch, [(last[s], length + step - 1, s, True) for s in range(nseq)])
            last = [lc.llama_sampler_sample(sampler, ctx, s) for s in range(nseq)]
            for s in range(nseq):
                out[s].append(last[s])
        end = time.perf_counter()
        return {"start": start, "first": first, "end": end, "tokens": out[0],
                "tokens_last": out[-1]}

    result = measure(args, timed)
    if args.logits_out:  # the last prompt position's logits, for the round-trip test
        ctx, batch, _ = context(1, args.prompt_len, args.max_tokens)
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        p = prompt_ids(1, args.prompt_len, vocab)[0]
        decode(ctx, batch, [(t, j, 0, j == len(p) - 1) for j, t in enumerate(p)])
        logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, -1), shape=(vocab,))
        np.save(args.logits_out, logits.copy())
    result["system_info"] = lc.llama_print_system_info().decode(errors="replace")
    result["llama_cpp_python"] = getattr(lc, "__version__", "?")
    lc.llama_sampler_free(sampler)
    for ctx, batch, _ in contexts.values():
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
    lc.llama_model_free(model)
    return result


def measure(args, timed) -> dict:
    """Warm up, then the timed batch-1 decode, (with --batch16) the batch-16 run and (with
    --long-prompt N) the prefill of one N-token prompt (the second of two: the first warms)."""
    timed(1, args.prompt_len, min(4, args.max_tokens))
    run = timed(1, args.prompt_len, args.max_tokens)
    result = {"b1": {"decode_tok_s": (args.max_tokens - 1) / (run["end"] - run["first"]),
                     "ttft_s": run["first"] - run["start"], "tokens": run["tokens"]}}
    if args.batch16:
        timed(args.batch16, args.b16_prompt_len, 2)
        run = timed(args.batch16, args.b16_prompt_len, args.b16_max_tokens)
        result["b16"] = {"total_tok_s": args.batch16 * args.b16_max_tokens
                         / (run["end"] - run["start"]), "total_s": run["end"] - run["start"],
                         "prefill_s": run["first"] - run["start"],
                         "tokens": run["tokens"], "tokens_last": run["tokens_last"]}
    if args.long_prompt:
        for _ in range(2):
            run = timed(1, args.long_prompt, 1)
        result["long"] = {"prefill_tok_s": args.long_prompt / (run["first"] - run["start"]),
                          "ttft_s": run["first"] - run["start"]}
    return result


def run_bandwidth(args) -> dict:
    """Read bandwidth (GB/s): the best of 5 passes over a 1.5 GiB float32 array of each of two
    library reads (torch's sum: one sequential stream per thread; MKL's gemv through torch.mv:
    several rows at once, faster on CPUs whose prefetchers keep more in flight for several
    streams)."""
    import torch

    x = torch.ones(3 * 2 ** 27)  # 1.5 GiB
    rows, v = x.view(-1, 1024), torch.ones(1024)
    best = 0.0
    for read in (x.sum, lambda: torch.mv(rows, v)):
        for _ in range(6):  # the first one also faults the pages in
            start = time.perf_counter()
            read()
            best = max(best, x.numel() * 4 / (time.perf_counter() - start) / 1e9)
    return {"read_gb_s": best}


def worker(args) -> None:
    if args.worker != "llamacpp":  # llama.cpp's process loads no torch (nor its OpenMP pool)
        import torch

        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    run = {"hf": run_hf, "llamacpp": run_llamacpp, "bandwidth": run_bandwidth}.get(
        args.worker, run_ours)
    result = run(args)
    result["process_s"] = time.perf_counter() - started
    result["peak_rss_mb"] = peak_rss_mb()
    result["anon_rss_mb"] = anon_rss_mb()
    print(_RESULT + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------------------------
# driver


def isa_info() -> dict:
    flags: set[str] = set()
    model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
                elif line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    wanted = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
              "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"]
    present = [f for f in wanted if f in flags]
    if "avx512f" in flags:
        isa = "AVX-512" + (" + AVX512-BF16" if "avx512_bf16" in flags else "") + (
            " + AMX" if "amx_tile" in flags else "")
    elif "avx2" in flags:
        isa = "AVX2" + (" + FMA" if "fma" in flags else "")
    else:
        isa = platform.machine()
    from vllm.utils.cpu_info import cpu_isa_level

    # the level our C++ kernels are built for in the engine's workers (VLLM_CPU_ISA lowers it)
    return {"cpu": model, "isa": isa, "flags": present, "logical_cpus": os.cpu_count(),
            "our_kernels": cpu_isa_level()}


def write_bf16_copy(src: str, dst: str) -> str:
    """A bfloat16 copy of the checkpoint folder `src` (weights cast, config dtype set)."""
    import torch
    from gguf_convert import load_state_dict
    from safetensors.torch import save_file

    if os.path.isfile(os.path.join(dst, "model.safetensors")):
        return dst
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name.endswith((".json", ".txt", ".model")) and "safetensors" not in name:
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    for key in ("torch_dtype", "dtype"):
        if key in config:
            config[key] = "bfloat16"
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in load_state_dict(src).items()}
    save_file(state, os.path.join(dst, "model.safetensors.tmp"), metadata={"format": "pt"})
    os.replace(os.path.join(dst, "model.safetensors.tmp"), os.path.join(dst, "model.safetensors"))
    return dst


def prepare(shape: str, dtype: str, root: str) -> dict:
    """The Hugging Face checkpoint and its GGUF for (shape, dtype), written once under root."""
    from checkpoints import write_checkpoint
    from gguf_convert import convert

    path = write_checkpoint(shape, root)
    if dtype == "bfloat16":
        path = write_bf16_copy(path, os.path.join(root, shape + "-bf16"))
    gguf_path = os.path.join(root, f"{shape}-{dtype}.gguf")
    stamp = os.path.join(root, f"{shape}-{dtype}.gguf.src")
    src = os.path.getmtime(os.path.join(path, "model.safetensors"))
    if not (os.path.isfile(gguf_path) and os.path.isfile(stamp)
            and open(stamp).read() == repr(src)):
        convert(path, gguf_path + ".tmp", dtype)
        os.replace(gguf_path + ".tmp", gguf_path)
        with open(stamp, "w") as f:
            f.write(repr(src))
    return {"path": path, "gguf": gguf_path, "weight_bytes": weight_bytes(path, dtype)}


def weight_bytes(path: str, dtype: str) -> int:
    """Weight bytes one decode step reads: every tensor but the input embedding table (only
    indexed), which counts once when it is tied as the LM head; 1-D tensors as float32."""
    from safetensors import safe_open

    with open(os.path.join(path, "config.json")) as f:
        tied = json.load(f).get("tie_word_embeddings", False)
    size = 2 if dtype == "bfloat16" else 4
    total = 0
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        names = list(f.keys())
        for name in names:
            shape = f.get_slice(name).get_shape()
            numel = 1
            for d in shape:
                numel *= d
            if name == "model.embed_tokens.weight" and not (
                    tied and "lm_head.weight" not in names):
                continue
            total += numel * (size if len(shape) >= 2 else 4)
    return total


# What makes each library of ours run its AVX2 code on a CPU that has more (--isa avx2).
AVX2_ENV = {"VLLM_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2",
            "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def limit_isa(args) -> None:
    """--isa avx2: every worker (they inherit this environment) runs AVX2 code only; llama.cpp
    must come from an AVX2 build (checked once it reports its features)."""
    from vllm.utils.cpu_info import supported_isa_levels

    if "avx2" not in supported_isa_levels():
        sys.exit(f"--isa avx2: this CPU cannot run AVX2 code (it has: "
                 f"{', '.join(supported_isa_levels()) or 'none of avx2, avx512, avx512_bf16'})")
    if "llamacpp" in args.engines and not os.environ.get("LLAMA_CPP_LIB_PATH"):
        sys.exit("--isa avx2: set LLAMA_CPP_LIB_PATH to an AVX2 build of llama.cpp's libraries "
                 "(bash benchmarks/build_llamacpp.sh avx2 prints it)")
    os.environ.update(AVX2_ENV)


def spawn(args, engine: str, case: dict | None = None, dtype: str = "float32",
          batch16: bool = False, extra: tuple[str, ...] = (), long_prompt: bool = False) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", engine, "--threads",
           str(args.threads), "--dtype", dtype, "--prompt-len", str(args.prompt_len),
           "--max-tokens", str(args.max_tokens), "--batch16", str(16 if batch16 else 0),
           "--b16-prompt-len", str(args.b16_prompt_len), "--b16-max-tokens",
           str(args.b16_max_tokens), "--llamacpp-kv", args.llamacpp_kv,
           "--llamacpp-flash-attn", args.llamacpp_flash_attn,
           "--long-prompt", str(args.long_prompt_len if long_prompt else 0)]
    if case:
        cmd += ["--path", case["path"], "--gguf", case["gguf"]]
    cmd += list(extra)  # overrides (argparse keeps the last value)
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": str(args.threads)}
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env,
                             timeout=args.worker_timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.worker_timeout} s"}
    line = [x for x in out.stdout.splitlines() if x.startswith(_RESULT)]
    if out.returncode != 0 or not line:
        return {"error": f"exit {out.returncode}: {out.stderr[-2000:]}"}
    return json.loads(line[-1][len(_RESULT):])


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def leading_match(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def summarize(args, cases: dict, runs: dict, bandwidths: list[float], machine: dict,
              llama_info: dict, exact: dict | None = None) -> dict:
    bw = max(bandwidths) if bandwidths else None  # the best reading: the least disturbed
    rows, checks = [], []
    for (shape, dtype), case in cases.items():
        for workload in (["b1"] + ["b16"] * (shape in args.batch16_shapes)
                         + ["long"] * (shape in args.long_prompt_shapes)):
            key = WORKLOAD_KEYS[workload]
            row = {"shape": shape, "dtype": dtype, "workload": workload,
                   "weight_bytes": case["weight_bytes"], "engines": {}}
            for engine in args.engines:
                vals = [r[workload][key] for r in runs[(shape, dtype, engine)]
                        if "error" not in r]
                errors = [r["error"] for r in runs[(shape, dtype, engine)] if "error" in r]
                med = median(vals)
                rss = [r["peak_rss_mb"] for r in runs[(shape, dtype, engine)]
                       if "error" not in r and "peak_rss_mb" in r]
                anon = [r["anon_rss_mb"] for r in runs[(shape, dtype, engine)]
                        if "error" not in r and r.get("anon_rss_mb") is not None]
                entry = {"tok_s": med, "rounds": vals, "errors": errors,
                         "peak_rss_mb": median(rss), "anon_rss_mb": median(anon)}
                if workload == "b1" and med is not None:
                    entry["weight_read_gb_s"] = case["weight_bytes"] * med / 1e9
                    entry["pct_of_bandwidth"] = 100 * entry["weight_read_gb_s"] / bw if bw else None
                row["engines"][engine] = entry
            ref = row["engines"].get("llamacpp", {}).get("tok_s")
            for entry in row["engines"].values():
                entry["vs_llamacpp"] = (entry["tok_s"] / ref if ref and entry["tok_s"]
                                        else None)
            rows.append(row)
        # greedy agreement: each engine's leading tokens against transformers' (first round)
        first = {e: next((r["b1"]["tokens"] for r in runs[(shape, dtype, e)]
                          if "error" not in r), None) for e in args.engines}
        if (exact or {}).get((shape, dtype)):
            first[EXACT] = exact[(shape, dtype)]
        ref_engine = "hf" if first.get("hf") else "llamacpp"
        ref = first.get(ref_engine)
        if ref:
            checks.append({"shape": shape, "dtype": dtype, "reference": ref_engine,
                           "tokens": ref[:CHECK_TOKENS],
                           "leading_match": {e: leading_match(t[:CHECK_TOKENS],
                                                              ref[:CHECK_TOKENS])
                                             for e, t in first.items() if t}})
    return {"machine": machine, "isa": args.isa,
            "bandwidth_gb_s": {"best": bw, "readings": bandwidths},
            "llama_cpp": {**llama_info, "kv_cache_type": args.llamacpp_kv,
                          "flash_attn": args.llamacpp_flash_attn},
            "threads": args.threads, "rounds": args.rounds,
            "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
            "batch16": {"prompt_len": args.b16_prompt_len, "max_tokens": args.b16_max_tokens,
                        "shapes": args.batch16_shapes},
            "long_prompt": {"prompt_len": args.long_prompt_len,
                            "shapes": args.long_prompt_shapes},
            "engines": args.engines, "rows": rows, "greedy_check": checks}


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "n/a" if x is None else format(x, spec)


def markdown(summary: dict) -> str:
    m, bw = summary["machine"], summary["bandwidth_gb_s"]
    engines = summary["engines"]
    ratios = [e for e in RATIO_ENGINES if e in engines and "llamacpp" in engines]
    lines = [
        "# Our engine against llama.cpp, same weights, one run",
        "",
        f"Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, ISA {m['isa']} "
        f"(flags: {' '.join(m['flags'])}); read bandwidth {fmt(bw['best'])} GB/s "
        f"(the best of {len(bw['readings'])} readings in this run, one per round and one at "
        f"the end: {', '.join(fmt(b) for b in bw['readings'])}; each the best of 5 sums "
        f"and 5 gemv (torch.mv) of a 1.5 GiB float32 array on {summary['threads']} "
        f"threads). Our C++ kernels built for: {m.get('our_kernels', '?')}"
        + (" (VLLM_CPU_ISA)." if os.environ.get("VLLM_CPU_ISA") else ".")
        + (" **Run as on an AVX2-only CPU** (`--isa avx2`): ours with "
           + ", ".join(f"{k}={v}" for k, v in AVX2_ENV.items())
           + "; llama.cpp an AVX2 build of the same version (LLAMA_CPP_LIB_PATH)."
           if summary.get("isa") == "avx2" else ""),
        f"llama.cpp: llama-cpp-python {summary['llama_cpp'].get('version', '?')}, "
        f"flash attention {summary['llama_cpp'].get('flash_attn', '?')}, KV cache "
        f"{summary['llama_cpp'].get('kv_cache_type', '?')} (llama.cpp's defaults: auto, f16), "
        f"built for: {summary['llama_cpp'].get('system_info', '?').strip()}",
        "",
        f"{summary['threads']} threads for every engine; random-weight checkpoints; fresh "
        f"process per engine and case; {summary['rounds']} interleaved rounds, medians. "
        f"Batch 1: {summary['max_tokens']} new tokens after a {summary['prompt_len']}-token "
        "prompt, greedy, EOS ignored, decode tok/s (first output token to last). Batch 16: "
        f"16 x {summary['batch16']['prompt_len']}-token prompts, "
        f"{summary['batch16']['max_tokens']} new tokens each, total output tok/s including "
        "the prefill (llama.cpp: the 16 sequences in one llama_batch, n_seq_max=16)."
        + (f" {LABELS[KV16]}: kv_cache_dtype=\"float16\" under float32 weights (under "
           "bfloat16 ones the cache is bfloat16 already), llama.cpp's default cache precision."
           if KV16 in engines else "")
        + (f" Long prompt: one {summary['long_prompt']['prompt_len']}-token prompt, prefill "
           "tok/s (prompt tokens / time to the first output token; the second of two runs)."
           if summary.get("long_prompt", {}).get("shapes") else ""),
        "",
        "| model | dtype | workload | " + " | ".join(LABELS[e] for e in engines)
        + "".join(f" | {RATIO_ENGINES[e]}" for e in ratios) + " |",
        "|---|---|---|" + "---|" * (len(engines) + len(ratios)),
    ]
    for r in summary["rows"]:
        work = {"b1": "batch-1 decode tok/s",
                "b16": "batch-16 total output tok/s incl. prefill",
                "long": f"{summary.get('long_prompt', {}).get('prompt_len')}-token prompt "
                        "prefill tok/s"}[r["workload"]]
        cells = [fmt(r["engines"][e]["tok_s"], ".2f") for e in engines]
        line = (f"| {SHAPE_LABELS.get(r['shape'], r['shape'])} | {r['dtype']} | {work} | "
                + " | ".join(cells) + " |")
        line += "".join(f" {fmt(r['engines'][e]['vs_llamacpp'], '.2f')}x |" for e in ratios)
        lines.append(line)
    lines += ["", "Batch-1 weight-read rate (weight bytes per token x decode tok/s), GB/s and "
              "% of the measured read bandwidth:", "",
              "| model | dtype | weight MB/token | "
              + " | ".join(LABELS[e] for e in engines) + " |",
              "|---|---|---|" + "---|" * len(engines)]
    for r in summary["rows"]:
        if r["workload"] != "b1":
            continue
        cells = []
        for e in engines:
            ent = r["engines"][e]
            cells.append("n/a" if ent["tok_s"] is None else
                         f"{ent['weight_read_gb_s']:.2f} ({fmt(ent['pct_of_bandwidth'], '.0f')}%)")
        lines.append(f"| {SHAPE_LABELS.get(r['shape'], r['shape'])} | {r['dtype']} | "
                     f"{r['weight_bytes'] / 1e6:.0f} | " + " | ".join(cells) + " |")
    lines += ["", "Resident memory of each engine's process, MB, median over rounds: peak (pages "
              "of mapped files included: ours reads the checkpoint through mmap while loading) "
              "/ at the end, not file-backed (what the process holds itself: llama.cpp computes "
              "from its mapped GGUF file, which is not counted there; ours at -O2/-O3 also "
              "holds a packed copy of the linear weights). One process runs a case's batch-1 "
              "and batch-16 workloads:", "",
              "| model | dtype | " + " | ".join(LABELS[e] for e in engines) + " |",
              "|---|---|" + "---|" * len(engines)]
    for r in summary["rows"]:
        if r["workload"] == "b1":
            lines.append(f"| {SHAPE_LABELS.get(r['shape'], r['shape'])} | {r['dtype']} | "
                         + " | ".join(fmt(r["engines"][e].get("peak_rss_mb"), ".0f") + " / "
                                      + fmt(r["engines"][e].get("anon_rss_mb"), ".0f")
                                      for e in engines) + " |")
    checked = engines + ([EXACT] if any(EXACT in c["leading_match"]
                                        for c in summary["greedy_check"]) else [])
    lines += ["", f"Greedy check: how many of the first {CHECK_TOKENS} batch-1 tokens of each "
              "engine equal the reference engine's (random weights give small logit margins: "
              "bfloat16, and llama.cpp's float16 KV cache and flash attention, may part early; "
              "float32 at the same math should agree):", "",
              "| model | dtype | reference | " + " | ".join(LABELS[e] for e in checked) + " |",
              "|---|---|---|" + "---|" * len(checked)]
    for c in summary["greedy_check"]:
        lines.append(f"| {SHAPE_LABELS.get(c['shape'], c['shape'])} | {c['dtype']} | "
                     f"{LABELS[c['reference']]} | "
                     + " | ".join(str(c["leading_match"].get(e, "n/a")) for e in checked)
                     + " |")
    errors = []  # each failed process once (it shows in its batch-1 and batch-16 rows)
    for r in summary["rows"]:
        if r["workload"] == "b1":
            errors += [(r["shape"], r["dtype"], e, err) for e, ent in r["engines"].items()
                       for err in ent["errors"]]
    if errors:
        lines += ["", "Failed runs:", ""]
        lines += [f"- {s} {d} {LABELS[e]}: {err.splitlines()[-1] if err else err}"
                  for s, d, e, err in errors]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: the 50M Llama only, 1 round, 16 new tokens, batch 16 "
                             "x 32-token prompts with 8 new tokens; results/vs_llamacpp_quick.*")
    parser.add_argument("--shapes", nargs="+", default=["llama-50m", "qwen2.5-0.5b"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16"])
    parser.add_argument("--engines", nargs="+", default=list(ENGINES),
                        choices=list(ENGINES) + [KV16])
    parser.add_argument("--batch16-shapes", nargs="*", default=["llama-50m"],
                        help="shapes that also run the batch-16 workload")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--b16-prompt-len", type=int, default=128)
    parser.add_argument("--b16-max-tokens", type=int, default=128)
    parser.add_argument("--long-prompt-shapes", nargs="*", default=[],
                        help="shapes that also run the long-prompt workload: the prefill of one "
                             "--long-prompt-len-token prompt (time to the first token)")
    parser.add_argument("--long-prompt-len", type=int, default=1024)
    parser.add_argument("--llamacpp-kv", default="f16", choices=sorted(GGML_TYPES),
                        help="llama.cpp's KV-cache type (default f16, llama.cpp's own default)")
    parser.add_argument("--llamacpp-flash-attn", default="auto", choices=sorted(FLASH_ATTN),
                        help="llama.cpp's flash attention (default auto, llama.cpp's own "
                             "default; it computes in float16 on the CPU)")
    parser.add_argument("--isa", default="native", choices=["native", "avx2"],
                        help="avx2: run both engines as on an AVX2-only CPU (see the module "
                             "docstring; llama.cpp from LLAMA_CPP_LIB_PATH)")
    parser.add_argument("--worker-timeout", type=float, default=3600)
    parser.add_argument("--ckpt-root", default=os.path.join(HERE, "results", "tmp"))
    parser.add_argument("--out", default=None,
                        help="output path without extension (default results/vs_llamacpp)")
    # worker-only
    parser.add_argument("--worker", choices=list(ENGINES) + [KV16, "bandwidth"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--gguf", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--batch16", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--long-prompt", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--logits-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.shapes, args.rounds, args.max_tokens = ["llama-50m"], 1, 16
        args.b16_prompt_len, args.b16_max_tokens = 32, 8
    for shape in args.shapes:
        if shape not in SHAPE_LABELS:
            raise ValueError(f"shape {shape!r} is not supported; use one of "
                             f"{sorted(SHAPE_LABELS)}")
    unknown = [s for s in args.long_prompt_shapes if s not in args.shapes]
    if unknown or args.long_prompt_len < 1:
        raise ValueError(f"--long-prompt-shapes must be among --shapes {args.shapes} (got "
                         f"{unknown}) and --long-prompt-len >= 1 (got {args.long_prompt_len})")
    if args.rounds < 1 or args.max_tokens < 2:
        raise ValueError(f"--rounds must be >= 1 and --max-tokens >= 2, got {args.rounds} and "
                         f"{args.max_tokens}")
    if "llamacpp" in args.engines:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            sys.exit("llama_cpp is not importable: pip install -e '.[bench]' "
                     "(llama-cpp-python and gguf)")
    if args.isa != "native":
        limit_isa(args)
    out = args.out or os.path.join(HERE, "results",
                                   "vs_llamacpp_quick" if args.quick else "vs_llamacpp")
    os.makedirs(args.ckpt_root, exist_ok=True)
    began = time.time()
    cases = {}
    for shape in args.shapes:
        for dtype in args.dtypes:
            cases[(shape, dtype)] = prepare(shape, dtype, args.ckpt_root)
            print(f"prepared {shape} {dtype}: {cases[(shape, dtype)]['gguf']}", flush=True)
    exact: dict = {}
    if "llamacpp" in args.engines:  # the conversion's sanity check: same weights, same math
        for (shape, dtype), case in cases.items():
            if dtype == "float32":
                res = spawn(args, "llamacpp", case, dtype, extra=(
                    "--llamacpp-kv", "f32", "--llamacpp-flash-attn", "off",
                    "--max-tokens", str(CHECK_TOKENS)))
                exact[(shape, dtype)] = res["b1"]["tokens"] if "b1" in res else None
                print(f"llama.cpp at float32 KV, no flash attention, {shape}: "
                      f"{exact[(shape, dtype)] or res.get('error')}", flush=True)
    runs = {(s, d, e): [] for (s, d) in cases for e in args.engines}
    bandwidths: list[float] = []
    llama_info: dict = {}
    for rnd in range(args.rounds):
        bw = spawn(args, "bandwidth")
        if "error" not in bw:
            bandwidths.append(bw["read_gb_s"])
        order = args.engines[rnd % len(args.engines):] + args.engines[:rnd % len(args.engines)]
        for (shape, dtype), case in cases.items():
            for engine in order:
                res = spawn(args, engine, case, dtype, shape in args.batch16_shapes,
                            long_prompt=shape in args.long_prompt_shapes)
                runs[(shape, dtype, engine)].append(res)
                if engine == "llamacpp" and "error" not in res:
                    llama_info = {"version": res.get("llama_cpp_python"),
                                  "system_info": res.get("system_info")}
                    if args.isa == "avx2" and "AVX512 = 1" in llama_info["system_info"]:
                        sys.exit("--isa avx2: llama.cpp was built with AVX-512 "
                                 f"({llama_info['system_info'].strip()}); build an AVX2 one "
                                 "(bash benchmarks/build_llamacpp.sh avx2) and name its "
                                 "libraries in LLAMA_CPP_LIB_PATH")
                brief = res.get("error", "").strip().splitlines()[-1:] or [
                    f"b1 {res['b1']['decode_tok_s']:.2f} tok/s"
                    + (f", b16 {res['b16']['total_tok_s']:.1f} tok/s" if "b16" in res else "")
                    + (f", long prompt {res['long']['prefill_tok_s']:.1f} tok/s"
                       if "long" in res else "")]
                print(f"round {rnd + 1}/{args.rounds} {shape} {dtype} {LABELS[engine]}: "
                      f"{brief[0]}", flush=True)
    bw = spawn(args, "bandwidth")
    if "error" not in bw:
        bandwidths.append(bw["read_gb_s"])
    summary = summarize(args, cases, runs, bandwidths, isa_info(), llama_info, exact)
    summary["wall_s"] = time.time() - began
    summary["runs"] = {f"{s}/{d}/{e}": v for (s, d, e), v in runs.items()}
    with open(out + ".json", "w") as f:
        json.dump(summary, f, indent=1)
    text = markdown(summary)
    with open(out + ".md", "w") as f:
        f.write(text)
    print(text)
    print(f"wrote {out}.md and {out}.json in {summary['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
