"""ModelRunner.execute_model in three parts: `_prepare_inputs` fills the persistent
InputBuffers and builds the attention metadata, `_run_model` runs the forward in the forward
context, `_sample` computes logits and samples; each is run here on its own, with stand-ins
for the model, the metadata builder and the CUDA-graph dispatcher."""
from __future__ import annotations

import types
from types import SimpleNamespace

import torch

from vllm.config.compilation import CUDAGraphMode
from vllm.engine.input_buffers import InputBuffers
from vllm.engine.model_runner import CachedRequestState, ModelRunner, PreparedBatch
from vllm.sampling_params import SamplingParams

BLOCK = 4


def _state(req_id, tokens, num_prompt, computed, blocks, **params):
    return CachedRequestState(req_id=req_id, prompt_token_ids=tokens[:num_prompt],
                              token_ids=list(tokens), sampling_params=SamplingParams(**params),
                              generator=None, block_ids=blocks, num_computed_tokens=computed)


class _Builder:
    def build(self, query_lens, seq_lens, block_tables, slot_mapping, num_padded_tokens=None,
              device="cpu"):
        return SimpleNamespace(query_lens=query_lens, seq_lens=seq_lens,
                               block_tables=block_tables, slot_mapping=slot_mapping,
                               num_padded_tokens=num_padded_tokens)


class _Model:
    """hidden = the token ids as one feature; logits favour token (id + 1) % 10."""

    def __init__(self):
        self.seen_modes = []

    def __call__(self, input_ids, positions):
        from vllm.forward_context import get_forward_context

        self.seen_modes.append(get_forward_context().cudagraph_runtime_mode)
        return input_ids.float().unsqueeze(1)

    def compute_logits(self, rows):
        return torch.nn.functional.one_hot((rows[:, 0].long() + 1) % 10, 10).float()


def _runner(states, padded_to=None):
    runner = SimpleNamespace(
        block_size=BLOCK, input_buffers=InputBuffers(16, 4, torch.device("cpu")),
        requests={s.req_id: s for s in states}, attn_metadata_builder=_Builder(),
        device=torch.device("cpu"), attention_layers={}, model=_Model(),
        vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=1)),
        is_driver=True)
    for name in ("_prepare_inputs", "_run_model", "_sample", "_sample_tokens",
                 "_sampling_metadata", "_prompt_logprobs"):
        setattr(runner, name, types.MethodType(getattr(ModelRunner, name), runner))

    def dispatch(num_tokens, num_reqs, uniform_decode):
        if padded_to is None:
            return CUDAGraphMode.NONE, None, num_tokens
        return CUDAGraphMode.FULL, ("descriptor", padded_to), padded_to

    runner._dispatch = dispatch
    from vllm.model_executor.layers.sampler import Sampler

    runner.sampler = Sampler()
    return runner


def _scheduled(**tokens):
    return SimpleNamespace(num_scheduled_tokens=tokens,
                           total_num_scheduled_tokens=sum(tokens.values()))


def test_prepare_inputs_fills_the_buffers_and_notes_the_sampling_rows():
    # a: a 6-token prompt, first chunk of 3 (no sample); b: decode of its 5th token (samples)
    a = _state("a", [11, 12, 13, 14, 15, 16], 6, 0, [7, 8], prompt_logprobs=1)
    b = _state("b", [21, 22, 23, 24, 25], 4, 4, [3, 5], temperature=0.0)
    runner = _runner([a, b])
    batch = runner._prepare_inputs(_scheduled(a=3, b=1))
    assert isinstance(batch, PreparedBatch)
    assert batch.req_ids == ["a", "b"]
    assert batch.input_ids.tolist() == [11, 12, 13, 25]
    assert batch.positions.tolist() == [0, 1, 2, 4]
    assert batch.input_ids.data_ptr() == runner.input_buffers.input_ids.data_ptr()
    md = batch.attn_metadata
    assert md.query_lens == [3, 1] and md.seq_lens == [3, 5]
    # slot = block_ids[pos // 4] * 4 + pos % 4
    assert md.slot_mapping == [28, 29, 30, 5 * 4 + 0]
    assert batch.sample_req_ids == ["b"] and batch.logits_indices == [3]
    assert batch.prompt_lp_rows == [("a", 0, 0, 3)]
    assert batch.cudagraph_mode == CUDAGraphMode.NONE and md.num_padded_tokens is None
    assert a.num_computed_tokens == 0  # moved on by execute_model, not here


def test_padding_lanes_are_zero_and_the_model_sees_the_dispatched_mode():
    b = _state("b", [21, 22, 23, 24, 25], 4, 4, [3, 5], temperature=0.0)
    c = _state("c", [31, 32, 33], 2, 2, [1], temperature=0.0)
    runner = _runner([b, c], padded_to=4)
    runner.input_buffers.input_ids_np[:] = 99  # stale values from an earlier step
    batch = runner._prepare_inputs(_scheduled(b=1, c=1))
    assert batch.input_ids.tolist() == [25, 33, 0, 0]
    assert batch.attn_metadata.num_padded_tokens == 4
    assert batch.batch_descriptor == ("descriptor", 4)
    hidden = runner._run_model(batch)
    assert hidden.shape == (4, 1) and runner.model.seen_modes == [CUDAGraphMode.FULL]
    output = runner._sample(hidden, batch)
    assert output.req_ids == ["b", "c"]
    assert output.sampled_token_ids == {"b": 6, "c": 4}  # (25 + 1) % 10, (33 + 1) % 10


def test_execute_model_is_the_three_parts_in_order(monkeypatch):
    calls = []
    runner = SimpleNamespace(requests={"b": SimpleNamespace(num_computed_tokens=4)},
                             _update_states=lambda so: calls.append("update"),
                             vllm_config=SimpleNamespace(
                                 parallel_config=SimpleNamespace(pipeline_parallel_size=1)))
    runner._prepare_inputs = lambda so: calls.append("prepare") or "batch"
    runner._run_model = lambda batch: calls.append(("run", batch)) or "hidden"
    runner._sample = lambda hidden, batch: calls.append(("sample", hidden, batch)) or "out"
    assert ModelRunner.execute_model.__wrapped__(runner, _scheduled(b=1)) == "out"
    assert calls == ["update", "prepare", ("run", "batch"), ("sample", "hidden", "batch")]
    assert runner.requests["b"].num_computed_tokens == 5
