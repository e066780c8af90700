"""End to end on a tiny random-weight Llama: LLM.generate against transformers, under prefix
caching, chunked prefill, preemption and aborts; sampling features; errors."""
from __future__ import annotations

import logging
import re

import pytest
import torch
from engine_test_utils import MAX_TOKENS, PROMPTS, assert_greedy_agrees

from vllm import LLM, SamplingParams


def greedy(max_tokens=MAX_TOKENS, **kw) -> SamplingParams:
    # min_tokens = max_tokens suppresses EOS, as transformers' min_new_tokens does.
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, **kw)


def test_greedy_matches_transformers(llm, hf_greedy):
    outputs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert [o.prompt for o in outputs] == PROMPTS
    for prompt, out in zip(PROMPTS, outputs):
        completion = out.outputs[0]
        assert completion.token_ids == hf_greedy(prompt), prompt
        assert completion.finish_reason == "length" and out.finished
        text = llm.get_tokenizer().decode(completion.token_ids, skip_special_tokens=True)
        assert completion.text == text
    # The two prompts sharing a prefix: the second run of the batch hits the cache.
    again = llm.generate(PROMPTS[2], greedy(), use_tqdm=False)[0]
    assert again.num_cached_tokens >= 16
    assert again.outputs[0].token_ids == hf_greedy(PROMPTS[2])


def test_generate_builds_final_outputs_only(llm, hf_greedy, monkeypatch):
    """LLM.generate returns finished requests only, so it asks for FINAL_ONLY outputs (none
    built per step), without changing the caller's SamplingParams."""
    from vllm.engine.output_processor import OutputProcessor
    from vllm.sampling_params import RequestOutputKind

    built = []
    process = OutputProcessor.process_outputs

    def counting(self, outputs):
        results, stopped = process(self, outputs)
        built.extend(results)
        return results, stopped

    monkeypatch.setattr(OutputProcessor, "process_outputs", counting)
    params = greedy()
    outputs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert len(built) == 2 and all(o.finished for o in built)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(p) for p in PROMPTS[:2]]
    assert params.output_kind == RequestOutputKind.CUMULATIVE


@pytest.mark.parametrize("kwargs", [
    {"enable_prefix_caching": False},
    {"max_num_batched_tokens": 16},
    {"num_gpu_blocks_override": 10, "max_model_len": 128},
], ids=["no-prefix-cache", "chunked-16", "preemption"])
def test_same_outputs_under_engine_settings(llama_path, hf_greedy, kwargs):
    llm = LLM(model=llama_path, optimization_level=0, **{"max_model_len": 256, **kwargs})
    params = greedy(24) if "num_gpu_blocks_override" in kwargs else greedy()
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.outputs[0].token_ids == hf_greedy(prompt, params.max_tokens), prompt
    stats = llm.llm_engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    if "num_gpu_blocks_override" in kwargs:
        assert stats["num_preemptions"] > 0
    if kwargs.get("enable_prefix_caching") is False:
        assert stats["prefix_cache_hits"] == 0


def test_abort_midway_frees_blocks(llm, hf_greedy):
    engine = llm.llm_engine
    start = engine.stats()["num_free_blocks"]
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"abort-{i}", prompt, greedy())
    for _ in range(3):
        engine.step()
    assert engine.stats()["num_free_blocks"] < start
    engine.abort_request("abort-1")
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {"abort-0", "abort-2"}
    assert finished["abort-2"].outputs[0].token_ids == hf_greedy(PROMPTS[2])
    assert engine.stats()["num_free_blocks"] == start
    assert engine.stats()["running"] == 0


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=10)
    alone = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids
    batched = llm.generate(PROMPTS, [params] + [SamplingParams(temperature=1.0, max_tokens=7)]
                           * (len(PROMPTS) - 1), use_tqdm=False)[0].outputs[0].token_ids
    assert alone == batched
    other = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=99, max_tokens=10)
    assert llm.generate(PROMPTS[0], other, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_completions(llm, hf_greedy):
    out = llm.generate(PROMPTS[1], SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=6),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert out.outputs[0].token_ids != out.outputs[1].token_ids
    out = llm.generate(PROMPTS[1], greedy(n=3, prompt_logprobs=0), use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [hf_greedy(PROMPTS[1])] * 3
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)


def test_stop_strings_and_stop_tokens(llm, hf_greedy):
    tokenizer = llm.get_tokenizer()
    ref_ids = hf_greedy(PROMPTS[1])
    full = tokenizer.decode(ref_ids, skip_special_tokens=True)
    start = next(i for i in range(2, len(full) - 2) if "\ufffd" not in full[i:i + 2])
    stop = full[start:start + 2]
    cut = full.find(stop)
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                  stop=[stop], min_tokens=1),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == full[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == ref_ids[:len(out.token_ids)]
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                  stop=stop, include_stop_str_in_output=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == full[:cut + len(stop)]
    stop_id = ref_ids[4]
    first = ref_ids.index(stop_id)
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                  stop_token_ids=[stop_id]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_eos_ignore_eos_and_min_tokens(llm, hf_greedy, monkeypatch):
    engine = llm.llm_engine
    ref_ids = hf_greedy(PROMPTS[0])
    eos = ref_ids[2]
    first = ref_ids.index(eos)
    monkeypatch.setattr(engine, "eos_token_ids", {eos})
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                  ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref_ids and out.finish_reason == "length"
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                  min_tokens=first + 2),
                       use_tqdm=False)[0].outputs[0]
    assert eos not in out.token_ids[:first + 2] and len(out.token_ids) >= first + 2


def test_logprobs_match_transformers(llm, hf_model, tokenizer):
    prompt = PROMPTS[1]
    out = llm.generate(prompt, greedy(6, logprobs=2, prompt_logprobs=1), use_tqdm=False)[0]
    completion = out.outputs[0]
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids + completion.token_ids])).logits[0].log_softmax(-1)
    assert len(completion.logprobs) == 6
    total = 0.0
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = ref[len(ids) - 1 + i]
        assert entry[token].rank == 1 and len(entry) <= 3
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        total += entry[token].logprob
    assert completion.cumulative_logprob == pytest.approx(total)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        entry = out.prompt_logprobs[pos]
        assert entry[ids[pos]].logprob == pytest.approx(ref[pos - 1, ids[pos]].item(),
                                                        abs=1e-4)
        rank = int((ref[pos - 1] > ref[pos - 1, ids[pos]]).sum()) + 1
        assert entry[ids[pos]].rank == rank


def test_logprobs_beyond_max_logprobs_are_refused_up_front(llm, llama_path):
    """More logprobs than max_logprobs (default 20) or the vocabulary is a ValueError naming
    both, before anything runs (it was a torch error from the sampler's topk mid-step);
    -1 asks for the whole vocabulary where max_logprobs=-1 allows it."""
    import math

    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"{name}=21 is more than the 20 allowed"):
            llm.generate(PROMPTS[0], greedy(2, **{name: 21}), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.generate(PROMPTS[0], greedy(2, logprobs=20), use_tqdm=False)[0]
               .outputs[0].logprobs[0]) >= 20

    whole = LLM(model=llama_path, optimization_level=0, max_model_len=64, max_logprobs=-1)
    vocab = whole.llm_engine.vocab_size
    with pytest.raises(ValueError, match=rf"logprobs={vocab + 1} is more than the {vocab}"):
        whole.generate(PROMPTS[0], greedy(2, logprobs=vocab + 1), use_tqdm=False)
    out = whole.generate(PROMPTS[0], greedy(2, logprobs=-1, prompt_logprobs=-1),
                         use_tqdm=False)[0]
    for entry in out.outputs[0].logprobs + out.prompt_logprobs[1:]:
        assert len(entry) == vocab
        assert math.fsum(math.exp(lp.logprob) for lp in entry.values()) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="max_logprobs must be an integer >= -1"):
        LLM(model=llama_path, optimization_level=0, max_model_len=64, max_logprobs=-2)


def test_kv_cache_dtype_stores_bfloat16(llm, llama_path):
    """kv_cache_dtype="bfloat16" (alias bf16) keeps the float32 model's keys and values in
    bfloat16: half the bytes per block, logprobs within bfloat16's rounding, and the same
    greedy tokens up to a near tie of the float32 run's top two (this random model's
    distribution is nearly flat); an unknown dtype is refused by name."""
    half = LLM(model=llama_path, optimization_level=0, max_model_len=256, kv_cache_dtype="bf16")
    caches = half.llm_engine.executor.worker.model_runner.kv_caches
    assert {c.dtype for c in caches.values()} == {torch.bfloat16}
    params = greedy(8, logprobs=2)
    for ours, ref in zip(half.generate(PROMPTS[:2], params, use_tqdm=False),
                         llm.generate(PROMPTS[:2], params, use_tqdm=False)):
        assert_greedy_agrees(ours, ref, 2e-2)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, .*fp8_e5m2; "
                                         "got 'int8'"):
        LLM(model=llama_path, optimization_level=0, kv_cache_dtype="int8")


@pytest.mark.parametrize("name,dtype,tol", [("fp8", torch.float8_e4m3fn, 0.1),
                                            ("fp8_e5m2", torch.float8_e5m2, 0.25)])
def test_kv_cache_dtype_fp8(llm, llama_path, name, dtype, tol, caplog):
    """kv_cache_dtype="fp8" (E4M3, as upstream's) and "fp8_e5m2": one byte a value, a quarter
    of the float32 model's cache per block; generation runs (through the CPU kernel where it
    is built) with the greedy tokens (up to a near tie) and the logprobs near the float32
    cache's (E5M2 keeps 2 bits of mantissa, E4M3 3)."""
    with caplog.at_level(logging.INFO, logger="vllm"):
        eight = LLM(model=llama_path, optimization_level=0, max_model_len=256,
                    kv_cache_dtype=name)
    assert re.search(rf"KV cache: .*, {str(dtype)[6:]}, \d+ bytes per block", caplog.text)
    runner = eight.llm_engine.executor.worker.model_runner
    assert {c.dtype for c in runner.kv_caches.values()} == {dtype}
    assert {layer.k_scale for layer in runner.attention_layers.values()} == {1.0}
    params = greedy(8, logprobs=2)
    for ours, ref in zip(eight.generate(PROMPTS[:2], params, use_tqdm=False),
                         llm.generate(PROMPTS[:2], params, use_tqdm=False)):
        assert_greedy_agrees(ours, ref, tol)


def test_kv_cache_is_mapped_for_huge_pages(llm):
    """Each layer's CPU KV cache of 2 MiB or more sits in a mapping of its own, advised for
    transparent huge pages, where this kernel offers them (vllm/utils/hugepages.py);
    elsewhere in torch's memory."""
    from vllm.utils.hugepages import HUGE_PAGE_BYTES, huge_pages_enabled

    caches = llm.llm_engine.executor.worker.model_runner.kv_caches
    big = [c for c in caches.values() if c.numel() * c.element_size() >= HUGE_PAGE_BYTES]
    if not big:
        pytest.skip("the test engine's caches are smaller than a huge page")
    for cache in big:
        own = (cache.data_ptr() % HUGE_PAGE_BYTES == 0 and cache.untyped_storage().nbytes()
               == cache.numel() * cache.element_size() + HUGE_PAGE_BYTES)
        assert own == huge_pages_enabled()


def test_logit_bias_and_allowed_token_ids(llm, hf_greedy):
    """logit_bias steers greedy decoding (+100 on one token: only that token), as does
    allowed_token_ids; a request in the same batch without them keeps transformers' tokens;
    token ids outside the vocabulary are refused by name."""
    biased = greedy(5, logit_bias={"7": 100.0})  # JSON-style string keys are accepted
    limited = greedy(5, allowed_token_ids=[11, 12])
    plain = greedy()
    outs = llm.generate(PROMPTS[:3], [biased, limited, plain], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == [7] * 5
    assert set(outs[1].outputs[0].token_ids) <= {11, 12}
    assert outs[2].outputs[0].token_ids == hf_greedy(PROMPTS[2])
    vocab = llm.llm_engine.vocab_size
    with pytest.raises(ValueError, match=rf"logit_bias has token ids outside the vocabulary "
                       rf"\[0, {vocab}\): \[{vocab}\]"):
        llm.generate(PROMPTS[0], greedy(2, logit_bias={vocab: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids must be a non-empty list"):
        greedy(2, allowed_token_ids=[])
    with pytest.raises(ValueError, match="logit_bias must be a dict of token id"):
        greedy(2, logit_bias={"x": 1.0})
    assert not llm.llm_engine.has_unfinished_requests()


def test_prompt_logprobs_computed_in_chunks_match_transformers(llm, hf_model, tokenizer,
                                                                monkeypatch):
    """Prompt logprobs are computed a few hundred positions at a time (a whole chunk's float32
    logits at once took gigabytes); here 2 at a time, so chunk edges fall inside the prompt."""
    from vllm.engine import model_runner

    monkeypatch.setattr(model_runner, "PROMPT_LOGPROBS_ROWS", 2)
    ids = tokenizer.encode(PROMPTS[1])
    assert len(ids) > 4
    out = llm.generate(PROMPTS[1], greedy(1, prompt_logprobs=1), use_tqdm=False)[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for pos in range(1, len(ids)):
        assert out.prompt_logprobs[pos][ids[pos]].logprob == pytest.approx(
            ref[pos - 1, ids[pos]].item(), abs=1e-4)


def test_token_prompts_and_chat(llm, hf_greedy, tokenizer):
    ids = tokenizer.encode(PROMPTS[1])
    out = llm.generate({"prompt_token_ids": ids}, greedy(), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids and out.outputs[0].token_ids == hf_greedy(PROMPTS[1])
    out = llm.chat([{"role": "user", "content": "Hello"}], greedy(4), use_tqdm=False)[0]
    assert out.prompt.endswith("assistant\n") and len(out.outputs[0].token_ids) == 4
    outs = llm.chat([[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Yo"}]],
                    greedy(2), use_tqdm=False)
    assert len(outs) == 2
    # OpenAI-style content parts render as their text (they rendered as a list's repr).
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
                     greedy(4), use_tqdm=False)[0]
    assert parts.prompt_token_ids == out.prompt_token_ids
    with pytest.raises(ValueError, match=r"conversation 0: .*content\[0\]: only text parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url"}]}], use_tqdm=False)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    """vLLM's truncate_prompt_tokens: the prompt's last N tokens (-1: max_model_len) are what
    the model sees, so a prompt longer than max_model_len can still run."""
    long_ids = [(7 * i) % 200 + 3 for i in range(300)]
    out = llm.generate({"prompt_token_ids": long_ids}, greedy(4, truncate_prompt_tokens=10),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == long_ids[-10:]
    alone = llm.generate({"prompt_token_ids": long_ids[-10:]}, greedy(4), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    fitted = llm.generate({"prompt_token_ids": long_ids}, greedy(1, truncate_prompt_tokens=-1),
                          use_tqdm=False)[0]
    assert len(fitted.prompt_token_ids) == 256  # max_model_len
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


def test_reset_prefix_cache(llm):
    llm.generate(PROMPTS[2], greedy(), use_tqdm=False)
    assert llm.generate(PROMPTS[2], greedy(), use_tqdm=False)[0].num_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    assert llm.generate(PROMPTS[2], greedy(), use_tqdm=False)[0].num_cached_tokens == 0


def test_prompt_too_long_fails_alone(llm, hf_greedy):
    long_prompt = {"prompt_token_ids": [5] * 300}
    with pytest.raises(ValueError, match=r"prompt 1: .*300 tokens.*max_model_len=256"):
        llm.generate([PROMPTS[0], long_prompt], greedy(), use_tqdm=False)
    engine = llm.llm_engine
    engine.add_request("ok", PROMPTS[0], greedy())
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("too-long", long_prompt, greedy())
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == ["ok"]
    assert done[0].outputs[0].token_ids == hf_greedy(PROMPTS[0])


def test_invalid_arguments(llm):
    with pytest.raises(ValueError, match="temperature"):
        llm.generate("x", SamplingParams(temperature=-1), use_tqdm=False)
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [SamplingParams(), SamplingParams(), SamplingParams()],
                     use_tqdm=False)
    with pytest.raises(ValueError, match="already in use"):
        llm.llm_engine.add_request("dup", "a", greedy(1))
        llm.llm_engine.add_request("dup", "b", greedy(1))
    llm.llm_engine.abort_request("dup")
    assert not llm.llm_engine.has_unfinished_requests()


def test_kv_cache_too_small_is_a_clear_error(llama_path):
    with pytest.raises(ValueError, match=r"bytes per block.*17 blocks needed.*5 available"):
        LLM(model=llama_path, optimization_level=0, max_model_len=256, num_gpu_blocks_override=5)
    with pytest.raises(ValueError, match="too small for one sequence"):
        LLM(model=llama_path, optimization_level="O0", max_model_len=256,
            kv_cache_memory=100_000)
    # Upstream's keyword for the same setting.
    with pytest.raises(ValueError, match="too small for one sequence"):
        LLM(model=llama_path, optimization_level="O0", max_model_len=256,
            kv_cache_memory_bytes=100_000)
    with pytest.raises(ValueError, match="both kv_cache_memory_bytes and kv_cache_memory"):
        LLM(model=llama_path, kv_cache_memory_bytes=1 << 20, kv_cache_memory=1 << 20)
    with pytest.raises(ValueError, match="unknown engine arguments"):
        LLM(model=llama_path, optimisation_level=0)


@pytest.mark.slow
def test_a_dropped_tensor_parallel_llm_leaves_no_process_group(llama_path):
    """`del llm` of a tensor-parallel engine (no shutdown()): its workers stop and this
    process leaves the process group, so the next LLM starts, of either size (it used to
    refuse: "tensor_parallel_size=1 but the tensor-parallel group has 2 rank(s)")."""
    import gc

    import torch.distributed as dist

    for size in (2, 1, 2):
        llm = LLM(model=llama_path, optimization_level=0, max_model_len=128,
                  tensor_parallel_size=size)
        assert len(llm.generate(PROMPTS[0], greedy(4), use_tqdm=False)[0].outputs[0]
                   .token_ids) == 4
        procs = list(getattr(llm.llm_engine.executor, "_procs", []))
        del llm
        gc.collect()
        assert not dist.is_initialized()
        assert not any(p.is_alive() for p in procs)



@pytest.mark.slow
def test_tensor_parallel_2_matches_transformers(llama_path, hf_greedy, capfd):
    """Two ranks (gloo on the CPU): rank 0 in this process, rank 1 spawned; the worker's log
    lines name its rank."""
    llm = LLM(model=llama_path, optimization_level=0, max_model_len=256,
              tensor_parallel_size=2, max_num_batched_tokens=16)
    try:
        outputs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
        for prompt, out in zip(PROMPTS, outputs):
            assert out.outputs[0].token_ids == hf_greedy(prompt), prompt
        seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=6)
        first = llm.generate(PROMPTS[0], seeded, use_tqdm=False)[0].outputs[0].token_ids
        assert llm.generate(PROMPTS[:2], seeded, use_tqdm=False)[0].outputs[0].token_ids \
            == first
    finally:
        llm.llm_engine.shutdown()
    assert not any(p.is_alive() for p in llm.llm_engine.executor._procs)
    worker_lines = [line for line in capfd.readouterr().err.splitlines()
                    if line.startswith("(TP rank=1 pid=")]
    assert worker_lines and any("INFO" in line for line in worker_lines)


def test_dummy_weights(llama_path):
    llm = LLM(model=llama_path, optimization_level=0, max_model_len=64, load_format="dummy")
    out = llm.generate("Hello", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_padded_batches_match(llama_path, hf_greedy):
    """Batches padded to CUDA-graph sizes (as the dispatcher pads them on CUDA): the padding
    lanes write into the reserved block 0 and never change the live requests' outputs."""
    from vllm.compilation.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.config.compilation import CUDAGraphMode

    llm = LLM(model=llama_path, optimization_level=0, max_model_len=256,
              max_num_batched_tokens=32)
    runner = llm.llm_engine.executor.worker.model_runner
    dispatcher = CudagraphDispatcher(runner.vllm_config)
    dispatcher.capture_sizes, dispatcher.max_capture_size = [8, 32], 32
    dispatcher._build_padding_table()
    dispatcher.initialize_cudagraph_keys(CUDAGraphMode.PIECEWISE)
    runner.cudagraph_dispatcher = dispatcher
    seen = []
    original = runner.attn_metadata_builder.build

    def build(*args, **kwargs):
        seen.append(kwargs.get("num_padded_tokens"))
        return original(*args, **kwargs)

    runner.attn_metadata_builder.build = build
    outputs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.outputs[0].token_ids == hf_greedy(prompt), prompt
    assert {8, 32} <= set(seen)
    # Warm-up / capture runs on dummy requests in block 0 work in both batch shapes.
    assert runner.dummy_run(8, 8, uniform=True).shape[0] == 8
    assert runner.dummy_run(20).shape[0] == 20
    assert llm.llm_engine.stats()["num_free_blocks"] == llm.llm_engine.stats()["num_total_blocks"]
    # The SDPA backend runs no full graphs: FULL parts fall back to piecewise (when the model
    # is compiled piecewise) or to none. Config resolution decides that (the rule the runner
    # checks its backend with); a resolved mode the backend cannot run is an error.
    from vllm.config.vllm import cudagraph_mode_for_backend

    support = runner.attn_backend.cudagraph_support
    assert cudagraph_mode_for_backend(CUDAGraphMode.FULL_AND_PIECEWISE, support,
                                      False) == CUDAGraphMode.NONE
    assert cudagraph_mode_for_backend(CUDAGraphMode.FULL_AND_PIECEWISE, support,
                                      True) == CUDAGraphMode.PIECEWISE
    assert cudagraph_mode_for_backend(CUDAGraphMode.FULL_DECODE_ONLY, support,
                                      True) == CUDAGraphMode.NONE
    cc = runner.vllm_config.compilation_config
    assert runner._resolved_cudagraph_mode() == cc.cudagraph_mode
    cc.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    try:
        with pytest.raises(RuntimeError, match="resolved for another backend"):
            runner._resolved_cudagraph_mode()
    finally:
        cc.cudagraph_mode = CUDAGraphMode.NONE


def test_generation_config_sources_and_overrides(llama_path, tmp_path):
    """--generation-config auto (the folder's generation_config.json) / vllm (none) / another
    folder, and --override-generation-config over it, as upstream."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(llama_path, model)
    (model / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 5, "eos_token_id": 2}))
    elsewhere = tmp_path / "gen"
    elsewhere.mkdir()
    (elsewhere / "generation_config.json").write_text(json.dumps({"top_k": 7}))

    def defaults(**kwargs):
        llm = LLM(model=str(model), optimization_level=0, max_model_len=64, **kwargs)
        params = llm.get_default_sampling_params()
        llm.llm_engine.shutdown()
        return params.temperature, params.top_p, params.top_k, params.max_tokens

    plain = SamplingParams()
    assert defaults(override_generation_config={"temperature": 0.2}) == (0.2, 0.9,
                                                                         plain.top_k, 5)
    assert defaults(generation_config="vllm", override_generation_config={"top_p": 0.5}) == \
        (plain.temperature, 0.5, plain.top_k, plain.max_tokens)
    assert defaults(generation_config=str(elsewhere)) == \
        (plain.temperature, plain.top_p, 7, plain.max_tokens)


@pytest.mark.parametrize("kwargs, match", [
    ({"generation_config": "/no/such/folder"}, "generation_config must be 'auto', 'vllm'"),
    ({"override_generation_config": {"temprature": 0.1}}, "unknown key.*temprature"),
    ({"tokenizer_mode": "mistral"}, "tokenizer_mode must be one of auto, slow"),
])
def test_generation_and_tokenizer_settings_are_checked(llama_path, kwargs, match):
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match=match):
        EngineArgs(model=llama_path, **kwargs).create_engine_config()


def test_slow_tokenizer_mode_asks_for_the_python_tokenizer(monkeypatch, caplog):
    from transformers import AutoTokenizer

    from vllm.engine.llm_engine import load_tokenizer

    seen = []
    class FastOnly:  # a folder with only tokenizer.json: AutoTokenizer falls back to fast
        is_fast = True

    monkeypatch.setattr(AutoTokenizer, "from_pretrained",
                        lambda path, **kw: seen.append(kw["use_fast"]) or FastOnly())
    with caplog.at_level(logging.WARNING, logger="vllm"):
        load_tokenizer("x", mode="slow")
        load_tokenizer("x")
    assert seen == [False, True]
    assert caplog.text.count("has no slow (Python) tokenizer") == 1


def test_bad_words_are_never_generated(llm, tokenizer):
    """vLLM's bad_words: a one-token word is banned at every step, so the output equals the
    one with that token's logit pushed down; a two-token word only loses its last token
    after its first."""
    ref = llm.generate(PROMPTS[0], greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    # a generated token whose text encodes back to just that token
    word = next(w for t in ref if (w := tokenizer.decode([t])).strip()
                and tokenizer.encode(w, add_special_tokens=False) == [t])
    params = greedy(8, bad_words=[word])
    params.update_from_tokenizer(tokenizer)
    banned = {seq[0] for seq in params._bad_words_token_ids if len(seq) == 1}
    assert banned, word
    out = llm.generate(PROMPTS[0], greedy(8, bad_words=[word]), use_tqdm=False)[0].outputs[0]
    assert not banned & set(out.token_ids)
    biased = llm.generate(PROMPTS[0], greedy(8, logit_bias=dict.fromkeys(banned, -100.0)),
                          use_tqdm=False)[0].outputs[0]
    assert out.token_ids == biased.token_ids
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=[""])


def test_bad_words_sequences_ban_the_last_token_after_the_rest():
    class Tok:
        def encode(self, text, add_special_tokens=False):
            return {"ab": [1, 2], " ab": [3, 2], "c": [4], " c": [4]}[text]

    params = SamplingParams(bad_words=["ab", "c"])
    params.update_from_tokenizer(Tok())
    assert params._bad_words_token_ids == [[1, 2], [3, 2], [4]]
    assert params.banned_by_bad_words([]) == {4}
    assert params.banned_by_bad_words([7, 1]) == {2, 4}
    assert params.banned_by_bad_words([3]) == {2, 4}
    assert params.banned_by_bad_words([1, 5]) == {4}
