"""`LLM`: offline batched generation over LLMEngine (`from vllm import LLM`)."""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from vllm.engine.llm_engine import LLMEngine, PromptType
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams

ChatMessage = dict[str, Any]


class LLM:
    """An engine for offline inference.

    `LLM(model="./m", optimization_level=1, max_model_len=512, ...)` takes every EngineArgs
    field as a keyword (e.g. `load_format="dummy"`); `generate` and `chat` run batches
    to completion and return RequestOutputs in input order.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        from vllm.engine.arg_utils import ENGINE_ARG_ALIASES, EngineArgs

        for alias, name in ENGINE_ARG_ALIASES.items():
            if alias in kwargs:
                if name in kwargs:
                    raise ValueError(f"LLM() got both {alias} and {name}; give one")
                kwargs[name] = kwargs.pop(alias)
        valid = {f.name for f in dataclasses.fields(EngineArgs)}
        unknown = sorted(set(kwargs) - valid)
        if unknown:
            raise ValueError(f"LLM() got unknown engine arguments {unknown}; valid ones: "
                             + ", ".join(sorted(valid)))
        # Offline use logs no periodic stats unless asked (as upstream).
        kwargs.setdefault("disable_log_stats", True)
        engine_args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(engine_args)
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        return self.llm_engine.get_default_sampling_params()

    def reset_prefix_cache(self) -> bool:
        """Drop the cached prefix blocks (False if a running request still holds some)."""
        return self.llm_engine.reset_prefix_cache()

    # ---- generation ---------------------------------------------------------------------
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., Any] = True) -> list[RequestOutput]:
        """Generate for one prompt or a list (str, {"prompt": ...} or
        {"prompt_token_ids": [...]}); `sampling_params` is one for all or one per prompt.
        `use_tqdm`: a progress bar of the finished prompts with the estimated input and output
        token speeds (True: tqdm's; a callable: the tqdm class to make it with; False: none).
        Every prompt is validated before anything runs: a bad one raises ValueError naming
        its index."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} "
                                 "prompts; pass one, or one per prompt")
        processed = []
        engine = self.llm_engine
        for index, prompt in enumerate(prompts):
            try:
                text, token_ids = engine.process_prompt(
                    prompt, params_list[index].truncate_prompt_tokens)
            except ValueError as exc:
                raise ValueError(f"prompt {index}: {exc}") from None
            processed.append({"prompt": text, "prompt_token_ids": token_ids})
        return self._run(processed, params_list, use_tqdm)

    def chat(self, messages: list[ChatMessage] | list[list[ChatMessage]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., Any] = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or a
        list of conversations, rendered with the tokenizer's chat template."""
        if not messages:
            raise ValueError("chat() needs at least one message")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template; pass chat_template=... or "
                             "use generate()")
        from vllm.entrypoints.openai.protocol import OpenAIError, normalize_messages

        prompts = []
        for index, conversation in enumerate(conversations):
            try:  # OpenAI-style content parts become text, as the server renders them
                conversation = normalize_messages(conversation)
            except OpenAIError as exc:
                raise ValueError(f"conversation {index}: {exc.message}") from None
            text = tokenizer.apply_chat_template(
                conversation, chat_template=chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
            # The template already holds the special tokens (BOS): do not add them twice.
            token_ids = tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": token_ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, prompts: list[dict], params_list: list[SamplingParams],
             use_tqdm: bool | Callable[..., Any]) -> list[RequestOutput]:
        engine = self.llm_engine
        order: dict[str, int] = {}
        for index, (prompt, params) in enumerate(zip(prompts, params_list)):
            request_id = str(next(self._request_counter))
            if params.output_kind != RequestOutputKind.FINAL_ONLY:
                # Only the final outputs are returned: no per-step outputs to build.
                params = params.clone()
                params.output_kind = RequestOutputKind.FINAL_ONLY
            engine.add_request(request_id, prompt, params)
            order[request_id] = index
        results: list[RequestOutput | None] = [None] * len(prompts)
        bar = _SpeedBar(len(prompts), use_tqdm) if use_tqdm else None
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished and output.request_id in order:
                        results[order[output.request_id]] = output
                        if bar is not None:
                            bar.finished(output)
        except BaseException:
            engine.abort_request(list(order))
            raise
        finally:
            if bar is not None:
                bar.close()
        return results


class _SpeedBar:
    """`LLM.generate`'s bar: prompts finished out of `total`, with upstream's postfix
    "est. speed input: X toks/s, output: Y toks/s" (the finished requests' prompt and
    generated tokens over the bar's elapsed time; the speeds of the requests still running
    are not counted yet, hence "est.")."""

    def __init__(self, total: int, use_tqdm: bool | Callable[..., Any]) -> None:
        if callable(use_tqdm):
            make = use_tqdm
        else:
            from tqdm.auto import tqdm as make
        self.input_tokens = self.output_tokens = 0
        self.bar = make(total=total, desc="Processed prompts", dynamic_ncols=True,
                        postfix=self.speeds(0.0))

    def speeds(self, elapsed: float) -> str:
        rate_in = self.input_tokens / elapsed if elapsed > 0 else 0.0
        rate_out = self.output_tokens / elapsed if elapsed > 0 else 0.0
        return f"est. speed input: {rate_in:.2f} toks/s, output: {rate_out:.2f} toks/s"

    def finished(self, output: RequestOutput) -> None:
        self.input_tokens += len(output.prompt_token_ids or ())
        self.output_tokens += sum(len(c.token_ids) for c in output.outputs)
        self.bar.postfix = self.speeds(self.bar.format_dict["elapsed"])
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
