"""TRITON_ATTN: the persistent decode metadata full CUDA graphs need (no Triton needed), and
the Triton paged-decode kernel against the reference and against TORCH_SDPA end to end, run in
Triton's interpreter on the CPU (skipped where Triton is not installed; on a GPU the CUDA e2e
tests run it compiled, inside full CUDA graphs)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from vllm.attention.backends.abstract import AttentionCGSupport
from vllm.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionMetadataBuilder,
)

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs Triton (its interpreter runs the kernel on CPU)")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_decode_metadata_stays_at_the_addresses_a_graph_captured():
    builder = TritonAttentionMetadataBuilder(max_rows=8, max_blocks=4)
    first = builder.build([1, 1, 1], [5, 1, 9], [[3, 4], [6], [7, 8, 2]], [20, 24, 34],
                          num_padded_tokens=4)
    assert first.decode_seq_lens.tolist() == [5, 1, 9, 0]  # the padding row attends to nothing
    assert first.decode_block_table.shape == (4, 4)
    assert first.decode_block_table[:3, :3].tolist() == [[3, 4, 0], [6, 0, 0], [7, 8, 2]]
    assert first.slot_mapping.tolist() == [20, 24, 34, 0]  # padding writes into block 0
    pointers = [t.data_ptr() for t in (first.decode_seq_lens, first.decode_block_table,
                                       first.slot_mapping)]
    # The next step's decode batch: new values, same addresses (what a replay reads).
    second = builder.build([1, 1], [6, 2], [[3, 4], [6]], [21, 25], num_padded_tokens=4)
    assert [t.data_ptr() for t in (second.decode_seq_lens, second.decode_block_table,
                                   second.slot_mapping)] == pointers
    assert second.decode_seq_lens.tolist() == [6, 2, 0, 0]
    assert second.slot_mapping.tolist() == [21, 25, 0, 0]
    # TORCH_SDPA's own fields are as its builder makes them (the other batches' path).
    assert second.seq_lens.tolist() == [6, 2] and second.block_table.shape == (2, 2)
    # Prompts and mixed batches take TORCH_SDPA's path: no decode tensors.
    assert builder.build([3, 1], [3, 7], [[1], [2]], [16, 17, 18, 38]).decode_seq_lens is None
    # A decode batch larger than the buffers (never a captured size) still runs, unpinned.
    big = builder.build([1] * 9, [1] * 9, [[1]] * 9, list(range(16, 25)))
    assert big.decode_seq_lens.tolist() == [1] * 9
    assert big.decode_seq_lens.data_ptr() != pointers[0]


def test_backend_reports_full_graphs_for_decode_and_is_refused_where_it_cannot_run(
        cpu_platform, monkeypatch):
    from vllm.attention.selector import get_attn_backend

    assert TritonAttentionBackend.cudagraph_support == \
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_ATTN cannot run here: .*TORCH_SDPA"):
        get_attn_backend(16, backend_name="TRITON_ATTN")


@pytest.mark.parametrize("platform", ["cpu", "cuda"], indirect=True)
@pytest.mark.parametrize("has_triton", [True, False])
def test_default_backend_is_triton_attn_on_cuda_with_triton(platform, has_triton, monkeypatch):
    from vllm.attention import selector

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        (real_find_spec("torch") if has_triton else None) if name == "triton"
        else real_find_spec(name, *a)))
    monkeypatch.delenv("VLLM_ATTENTION_BACKEND", raising=False)
    expected = "TRITON_ATTN" if platform.is_cuda() and has_triton else "TORCH_SDPA"
    assert selector.default_backend_name() == expected
    assert selector.default_backend().get_name() == expected
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "torch_sdpa")  # the user's choice wins
    assert selector.default_backend_name() == "TORCH_SDPA"


def test_a_failing_decode_kernel_is_named_with_the_way_around_it(monkeypatch):
    """Here the kernel cannot run (no Triton, or Triton without its interpreter on CPU
    tensors): the error says which kernel failed and how to run without it."""
    from vllm.attention.backends.triton_attn import TritonAttentionImpl

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if importlib.util.find_spec("triton") is not None:
        import triton

        if getattr(getattr(triton, "knobs", None), "runtime", None) is not None:
            monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    impl = TritonAttentionImpl(2, 8, 0.3, num_kv_heads=1)
    md = TritonAttentionMetadataBuilder(max_rows=4, max_blocks=2).build(
        [1, 1], [3, 1], [[1], [2]], [18, 32])
    kv_cache = torch.zeros(2, 3, 16, 1, 8)
    query, key = torch.randn(2, 16), torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="TRITON_ATTN decode kernel failed .*"
                                           "VLLM_ATTENTION_BACKEND=TORCH_SDPA"):
        impl.forward(None, query, key, key.clone(), kv_cache, md, torch.empty_like(query))
    # The step's K/V were written before the kernel ran.
    assert torch.equal(kv_cache[0, 1, 2, 0], key[0]) and torch.equal(kv_cache[1, 2, 0, 0],
                                                                      key[1])


def test_a_kv_cache_of_another_dtype_still_takes_the_graph_safe_decode_path(monkeypatch):
    """float32 activations over a bfloat16 KV cache: the decode batch is written converted and
    attended by the kernel. (It used to fall back to TORCH_SDPA's path, which sizes its work
    from host values: a full CUDA graph would have recorded the capture's sizes.)"""
    import types

    from vllm.attention.backends import torch_sdpa
    from vllm.attention.backends.triton_attn import TritonAttentionImpl

    calls = []
    fake = types.ModuleType("triton_decode_kernel")
    fake.paged_decode = lambda q, kv, table, lens, scale, out, **kw: calls.append(
        (kv.dtype, lens.tolist()))
    monkeypatch.setitem(sys.modules, "vllm.attention.backends.triton_decode_kernel", fake)
    monkeypatch.setattr(torch_sdpa.TorchSDPAImpl, "forward", lambda *a, **k: pytest.fail(
        "a decode batch took TORCH_SDPA's path"))
    impl = TritonAttentionImpl(2, 8, 0.3, num_kv_heads=1)
    md = TritonAttentionMetadataBuilder(max_rows=4, max_blocks=2).build(
        [1, 1], [3, 1], [[1], [2]], [18, 32])
    kv_cache = torch.zeros(2, 3, 16, 1, 8, dtype=torch.bfloat16)
    query, key, value = torch.randn(2, 16), torch.randn(2, 8), torch.randn(2, 8)
    impl.forward(None, query, key, value, kv_cache, md, torch.empty_like(query))
    assert calls == [(torch.bfloat16, [3, 1])]
    assert torch.equal(kv_cache[0, 1, 2, 0], key[0].bfloat16())
    assert torch.equal(kv_cache[1, 2, 0, 0], value[1].bfloat16())


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_an_fp8_cache_is_written_scaled_and_its_scales_reach_the_decode_kernel(cache_dtype,
                                                                              monkeypatch):
    """kv_cache_dtype fp8: the decode batch's K/V go into the cache as the CPU paths store them
    (K / k_scale, V / v_scale, saturated; through byte views), and the kernel gets the scales."""
    import types

    from vllm.attention.backends.cache_storage import to_cache
    from vllm.attention.backends.triton_attn import TritonAttentionImpl

    calls = []
    fake = types.ModuleType("triton_decode_kernel")
    fake.paged_decode = lambda q, kv, table, lens, scale, out, **kw: calls.append(
        (kv.dtype, kw["k_scale"], kw["v_scale"]))
    monkeypatch.setitem(sys.modules, "vllm.attention.backends.triton_decode_kernel", fake)
    layer = types.SimpleNamespace(k_scale=0.5, v_scale=4.0)
    impl = TritonAttentionImpl(2, 8, 0.3, num_kv_heads=1)
    md = TritonAttentionMetadataBuilder(max_rows=4, max_blocks=2).build(
        [1, 1], [3, 1], [[1], [2]], [18, 32])
    kv_cache = torch.zeros(2, 3, 16, 1, 8, dtype=cache_dtype)
    query, key, value = torch.randn(2, 16), torch.randn(2, 8) * 500, torch.randn(2, 8)
    impl.forward(layer, query, key, value, kv_cache, md, torch.empty_like(query))
    assert calls == [(cache_dtype, 0.5, 4.0)]
    bytes_of = lambda t: t.view(torch.uint8)  # noqa: E731
    assert torch.equal(bytes_of(kv_cache[0, 1, 2, 0]), bytes_of(to_cache(key[0], cache_dtype,
                                                                         0.5)))
    assert torch.equal(bytes_of(kv_cache[1, 2, 0, 0]), bytes_of(to_cache(value[1], cache_dtype,
                                                                         4.0)))
    assert kv_cache.float().isfinite().all()


def test_buffers_are_kept_for_a_device_named_without_its_index(monkeypatch):
    """"cuda" and "cuda:0" are unequal torch.device objects: the persistent buffers (the
    addresses graphs record) must not be reallocated because of the spelling."""
    from vllm.attention.backends.triton_attn import _same_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert _same_device(torch.device("cuda", 0), "cuda")
    assert not _same_device(torch.device("cuda", 1), "cuda")
    assert _same_device(torch.device("cuda", 1), "cuda:1")
    assert _same_device(torch.device("cpu"), "cpu") and not _same_device(torch.device("cpu"),
                                                                            "cuda")
    builder = TritonAttentionMetadataBuilder(max_rows=4, max_blocks=2, device="cpu")
    first = builder._persistent("cpu")[0].data_ptr()
    assert builder._persistent(torch.device("cpu"))[0].data_ptr() == first


def run_with_interpreter(code: str, backend: str | None = None) -> str:
    """`code`'s stdout, run in a new process with Triton's interpreter on (and
    VLLM_ATTENTION_BACKEND=`backend`)."""
    # On the CPU platform even where a GPU is visible: the interpreter runs on host tensors.
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path, "VLLM_PLATFORM": "cpu",
           "CUDA_VISIBLE_DEVICES": ""}
    env.pop("VLLM_ATTENTION_BACKEND", None)
    if backend is not None:
        env["VLLM_ATTENTION_BACKEND"] = backend
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def last_json(stdout: str) -> object:
    return json.loads(stdout.splitlines()[-1])


@needs_triton
def test_decode_kernel_matches_the_reference():
    """GQA, a head size that is no power of two, block sizes 4 and 16, a sliding window,
    row-strided queries, block tables in any order, and padding rows (length 0: zeros)."""
    out = run_with_interpreter("""
        import torch
        from vllm.attention.backends.cpu_paged_kernel import paged_attention_reference
        from vllm.attention.backends.triton_decode_kernel import paged_decode
        torch.manual_seed(0)
        for heads, kv_heads, head_size, block_size, window in [
                (4, 2, 16, 4, None), (6, 2, 24, 16, 5), (2, 2, 8, 8, None), (8, 1, 16, 4, 9)]:
            kv = torch.randn(2, 12, block_size, kv_heads, head_size)
            lens = [min(n, 8 * block_size) for n in (7, 1, 0, 13, 30)]
            table = torch.zeros(7, 8, dtype=torch.int32)
            for i in range(5):
                table[i] = torch.randperm(11)[:8].int() + 1
            q = torch.randn(5, 2 * heads * head_size)[:, :heads * head_size]
            q = q.view(5, heads, head_size)
            out = torch.full((5, heads, head_size), 7.0)
            paged_decode(q, kv, table, torch.tensor(lens + [0, 0]), 0.3, out, window)
            ref = torch.zeros(5, heads, head_size)
            live = torch.tensor([i for i in range(5) if lens[i]])
            paged_attention_reference(q.contiguous(), kv, table[:5], torch.tensor(lens),
                                      torch.arange(6), live, 0.3, ref, window)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
            assert out[2].abs().max() == 0
        print("OK")
    """)
    assert out.strip().endswith("OK")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,cache_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float8_e5m2), (torch.bfloat16, torch.float8_e4m3fn)])
def test_decode_kernel_compiled_on_cuda_matches_the_reference(dtype, cache_dtype):
    from vllm.attention.backends.cpu_paged_kernel import paged_attention_reference
    from vllm.attention.backends.triton_decode_kernel import paged_decode

    torch.manual_seed(0)
    heads, kv_heads, head_size, block_size = 8, 2, 128, 16
    kv = torch.randn(2, 40, block_size, kv_heads, head_size).to(cache_dtype)
    scales = (0.5, 2.0) if kv.element_size() == 1 else (1.0, 1.0)
    lens = [100, 1, 0, 33, 257 % (38 * block_size)]
    table = torch.zeros(6, 38, dtype=torch.int32)
    for i in range(5):
        table[i] = torch.randperm(39)[:38].int() + 1
    q = torch.randn(5, heads, head_size, dtype=dtype)
    for window in (None, 20):
        out = torch.empty(5, heads, head_size, dtype=dtype, device="cuda")
        paged_decode(q.cuda(), kv.cuda(), table.cuda(), torch.tensor(lens + [0]).cuda(), 0.1,
                     out, window, k_scale=scales[0], v_scale=scales[1])
        ref = torch.zeros(5, heads, head_size, dtype=dtype)
        live = torch.tensor([i for i in range(5) if lens[i]])
        paged_attention_reference(q, kv, table[:5], torch.tensor(lens), torch.arange(6), live,
                                  0.1, ref, window, k_scale=scales[0], v_scale=scales[1])
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.cpu(), ref, atol=tol, rtol=tol)


@needs_triton
@pytest.mark.parametrize("model, overrides", [("qwen3", {}), ("mistral", {"sliding_window": 8})])
def test_engine_with_triton_attn_generates_what_torch_sdpa_does(tmp_path, model, overrides):
    """Prompts and chunks take TORCH_SDPA's path, decode batches the Triton kernel: under
    continuous batching the tokens are TORCH_SDPA's (-O0; Qwen3 with GQA, Mistral with a
    sliding window shorter than the sequences)."""
    from tests.model_executor.hf_checkpoints import MAKERS

    path = MAKERS[model](tmp_path / model, **overrides)
    code = f"""
        import json, os, sys
        import torch
        from vllm import LLM, SamplingParams
        llm = LLM(model={str(path)!r}, optimization_level=0, max_model_len=128,
                  max_num_batched_tokens=24, max_num_seqs=8, kv_cache_memory="16MiB")
        g = torch.Generator().manual_seed(0)
        prompts = [{{"prompt_token_ids": torch.randint(3, 384, (n,), generator=g).tolist()}}
                   for n in [1, 5, 37, 3, 18]]
        out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5,
                                                   min_tokens=5), use_tqdm=False)
        layer = next(iter(llm.llm_engine.executor.worker.model_runner.attention_layers.values()))
        print(json.dumps([layer.attn_backend.get_name(), [o.outputs[0].token_ids for o in out]]))
    """
    triton_name, triton_tokens = last_json(run_with_interpreter(code, "TRITON_ATTN"))
    sdpa_name, sdpa_tokens = last_json(run_with_interpreter(code))
    assert (triton_name, sdpa_name) == ("TRITON_ATTN", "TORCH_SDPA")
    assert triton_tokens == sdpa_tokens


@needs_triton
def test_decode_graphs_replay_with_the_captured_metadata(tmp_path):
    """The full-graph contract, checked on the CPU: a replay stands for the kernels recorded
    at capture, so it may only see the metadata *objects* of the capture (their tensors at
    the captured addresses), never the step's own. A fake graph that replays with the
    captured metadata must still generate TORCH_SDPA's tokens: every value a decode step
    changes reaches the captured tensors in place."""
    from tests.model_executor.hf_checkpoints import make_qwen3

    path = make_qwen3(tmp_path / "qwen3")
    code = f"""
        import json
        import torch
        from vllm import LLM, SamplingParams
        from vllm.compilation.cuda_graph import FakeCUDAGraph, override_graph_factory
        from vllm.config.compilation import CUDAGraphMode
        from vllm.forward_context import get_forward_context

        class ReplayWithCapturedMetadata(FakeCUDAGraph):
            def capture(self, fn):
                self.metadata = get_forward_context().attn_metadata
                return super().capture(fn)

            def replay(self):
                context = get_forward_context()
                live, context.attn_metadata = context.attn_metadata, self.metadata
                try:
                    super().replay()
                finally:
                    context.attn_metadata = live

        llm = LLM(model={str(path)!r}, optimization_level=0, max_model_len=128,
                  max_num_batched_tokens=24, max_num_seqs=8, kv_cache_memory="16MiB")
        runner = llm.llm_engine.executor.worker.model_runner
        if runner.attn_backend.get_name() == "TRITON_ATTN":
            # The CPU has no CUDA graphs: decode-only full graphs, captured with the fake.
            cc = runner.vllm_config.compilation_config
            cc.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
            cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size = [1, 2, 4, 8], 8
            with override_graph_factory(ReplayWithCapturedMetadata), torch.inference_mode():
                runner.capture_model()
        g = torch.Generator().manual_seed(1)
        prompts = [{{"prompt_token_ids": torch.randint(3, 384, (n,), generator=g).tolist()}}
                   for n in [1, 5, 37, 3, 18, 9]]
        out = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)
                                     for n in [12, 6, 16, 10, 14, 8]], use_tqdm=False)
        entries = getattr(runner.model, "entries", {{}})
        print(json.dumps([sum(e.replays for e in entries.values()),
                          [o.outputs[0].token_ids for o in out]]))
    """
    replays, tokens = last_json(run_with_interpreter(code, "TRITON_ATTN"))
    none, reference = last_json(run_with_interpreter(code))
    assert none == 0 and replays >= 8
    assert tokens == reference
