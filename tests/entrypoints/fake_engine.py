"""A small stand-in for `LLMEngine` that follows its contract (add_request, step, abort_request,
has_unfinished_requests, stats, tokenizer, vllm_config), for fast serving tests.

Tokens are characters: id = ord(c) + 3 (0 pad, 1 BOS, 2 EOS). A greedy sequence continues
the alphabet after the last character of the prompt ("...c" -> "defg..."), and emits EOS
after "z" unless ignore_eos. Seeded sampling (temperature > 0) picks letters from a
per-request RNG. KV blocks: ceil(tokens / block_size) per running sequence; a request waits
while the pool or max_num_seqs is full.
"""
from __future__ import annotations

import math
import random
import time
from types import SimpleNamespace
from typing import Any

from vllm.outputs import CompletionOutput, Logprob, RequestOutput

PAD, BOS, EOS = 0, 1, 2
VOCAB = 256


class FakeTokenizer:
    bos_token_id = BOS
    eos_token_id = EOS
    all_special_ids = [PAD, BOS, EOS]
    chat_template = "fake"

    def __len__(self) -> int:
        return VOCAB

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [min(ord(c), VOCAB - 4) + 3 for c in text]
        return [BOS, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i - 3) for i in ids if i >= 3)

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False,
                            add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            chat_template: str | None = None, **_: Any) -> str:
        if chat_template is not None:  # rendered with Jinja, as transformers does
            import jinja2

            return jinja2.Environment().from_string(chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt)
        for m in messages:
            if m["role"] == "tool":
                raise ValueError("tool messages are not supported by this template")
        text = "".join(f"[{m['role']}]{m['content']}\n" for m in messages)
        if continue_final_message:
            text = text[:-1]
        return text + ("[assistant]" if add_generation_prompt else "")


class _Seq:
    def __init__(self, index: int) -> None:
        self.index = index
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[dict[int, Logprob]] | None = None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None


class _Req:
    def __init__(self, rid: str, prompt: str | None, ids: list[int], params: Any) -> None:
        self.rid = rid
        self.prompt = prompt
        self.ids = ids
        self.params = params
        self.seqs = [_Seq(i) for i in range(params.n)]
        for s in self.seqs:
            s.logprobs = [] if params.logprobs is not None else None
        self.rng = random.Random(params.seed)
        self.blocks = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason for s in self.seqs)


class FakeEngine:
    def __init__(self, max_model_len: int = 128, num_blocks: int = 64, block_size: int = 4,
                 max_num_seqs: int = 8, step_delay: float = 0.0) -> None:
        self.tokenizer = FakeTokenizer()
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.step_delay = step_delay
        self.fail_next_step = False
        self.model_config = SimpleNamespace(max_model_len=max_model_len, model="/models/fake",
                                            get_vocab_size=lambda: VOCAB)
        self.vllm_config = SimpleNamespace(model_config=self.model_config)
        self.startup_phases = {"load_weights": 0.25, "compile": 0.0}
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.num_steps = 0
        self.batch_sizes: list[int] = []
        self.aborted: list[str] = []

    # ---- contract -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Any, sampling_params: Any) -> None:
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is "
                             f"{self.max_model_len}")
        if any(r.rid == request_id for r in self.waiting + self.running):
            raise ValueError(f"request id {request_id!r} is already in use")
        self.waiting.append(_Req(request_id, text, ids, sampling_params))

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.waiting = [r for r in self.waiting if r.rid != request_id]
        self.running = [r for r in self.running if r.rid != request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def _used_blocks(self) -> int:
        return sum(self._blocks_for(r) for r in self.running)

    def _blocks_for(self, r: _Req) -> int:
        longest = max(len(s.token_ids) for s in r.seqs)
        return len(r.seqs) * math.ceil((len(r.ids) + longest + 1) / self.block_size)

    def stats(self) -> dict:
        used = self._used_blocks()
        return {"running": len(self.running), "waiting": len(self.waiting),
                "num_free_blocks": self.num_blocks - used, "num_total_blocks": self.num_blocks}

    def step(self) -> list[RequestOutput]:
        if self.fail_next_step:
            raise RuntimeError("injected step failure")
        if self.step_delay:
            time.sleep(self.step_delay)
        self.num_steps += 1
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            if self._used_blocks() + self._blocks_for(r) > self.num_blocks and self.running:
                break
            self.running.append(self.waiting.pop(0))
        self.batch_sizes.append(len(self.running))
        outputs = []
        for r in list(self.running):
            for s in r.seqs:
                if s.finish_reason is None:
                    self._advance(r, s)
            outputs.append(self._output(r))
            if r.finished:
                self.running.remove(r)
        return outputs

    # ---- generation -----------------------------------------------------------------------
    def _next(self, r: _Req, s: _Seq) -> int:
        p = r.params
        if p.temperature > 0:
            return ord("a") + 3 + r.rng.randrange(26)
        last = (s.token_ids or r.ids)[-1] - 3
        ch = chr(last)
        if "a" <= ch < "z":
            return ord(ch) + 1 + 3
        if ch == "z":
            return EOS if not p.ignore_eos and len(s.token_ids) >= p.min_tokens else ord("a") + 3
        return ord("a") + 3

    def _advance(self, r: _Req, s: _Seq) -> None:
        p = r.params
        tok = self._next(r, s)
        s.token_ids.append(tok)
        if s.logprobs is not None:
            entry = {tok: Logprob(-0.5, 1, self.tokenizer.decode([tok]))}
            for k in range(p.logprobs):
                alt = ord("A") + 3 + k
                entry.setdefault(alt, Logprob(-2.0 - k, k + 2, chr(alt - 3)))
            s.logprobs.append(entry)
        if tok == EOS:
            s.finish_reason = "stop"
            return
        s.text += self.tokenizer.decode([tok])
        for stop in p.stop:
            at = s.text.find(stop)
            if at != -1 and len(s.token_ids) >= p.min_tokens:
                s.text = s.text[:at + len(stop)] if p.include_stop_str_in_output else s.text[:at]
                s.finish_reason, s.stop_reason = "stop", stop
                return
        if len(s.token_ids) >= p.max_tokens or len(r.ids) + len(s.token_ids) >= \
                self.max_model_len:
            s.finish_reason = "length"

    def _output(self, r: _Req) -> RequestOutput:
        # Like the real engine, hold back text that may be the start of a stop string.
        hold = max((len(x) for x in r.params.stop), default=1) - 1

        def visible(s: _Seq) -> str:
            return s.text if s.finish_reason or not hold else s.text[:max(len(s.text) - hold, 0)]

        return RequestOutput(
            request_id=r.rid, prompt=r.prompt, prompt_token_ids=list(r.ids),
            prompt_logprobs=None, finished=r.finished,
            outputs=[CompletionOutput(s.index, visible(s), list(s.token_ids),
                                      None if s.logprobs is None else -0.5 * len(s.token_ids),
                                      None if s.logprobs is None else list(s.logprobs),
                                      s.finish_reason, s.stop_reason) for s in r.seqs])


def greedy_continuation(prompt: str, max_tokens: int) -> str:
    """What FakeEngine generates greedily (ignore_eos) after `prompt`."""
    ch = prompt[-1] if prompt else "\0"
    out = []
    for _ in range(max_tokens):
        ch = chr(ord(ch) + 1) if "a" <= ch < "z" else "a"
        out.append(ch)
    return "".join(out)
