"""POST /tokenize and /detokenize (vLLM's endpoints): the server's own tokenizer and chat
template, so that a client counts tokens exactly as the completions it sends will."""
from __future__ import annotations

from vllm.entrypoints.openai.protocol import DetokenizeRequest, OpenAIError, TokenizeRequest
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat


class OpenAIServingTokenization:
    """Tokenizes with the chat handler's tokenizer and template (one per server)."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    async def tokenize(self, request: TokenizeRequest) -> dict:
        """{"count", "max_model_len", "tokens"} (+ "token_strs" when asked); 400 unless
        exactly one of prompt and messages is given, or for a text longer than
        max_model_len tokens can hold. Runs in the tokenizer thread."""
        self.chat.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError("give either prompt or messages", 400, "prompt")
        if request.messages is not None:
            self.chat.check_messages_length(request)
        else:
            self.chat.check_text_length(len(request.prompt), "prompt")
        return await self.chat.off_loop(lambda: self._tokenize(request), "tokenizing")

    async def detokenize(self, request: DetokenizeRequest) -> dict:
        """{"prompt": text}; 400 naming `tokens` for an id outside the vocabulary or more
        tokens than max_model_len. Runs in the tokenizer thread."""
        self.chat.check_model(request.model)
        if len(request.tokens) > self.chat.max_model_len:
            raise OpenAIError(f"tokens holds {len(request.tokens)} ids, more than "
                              f"max_model_len ({self.chat.max_model_len})", 400, "tokens")
        return await self.chat.off_loop(lambda: self._detokenize(request), "detokenizing")

    def _tokenize(self, request: TokenizeRequest) -> dict:
        if request.messages is not None:
            ids = self.chat.render(request)  # the chat request's rendering, same fields
        else:
            ids = self.chat.tokenize(request.prompt,
                                     add_special_tokens=request.add_special_tokens)
        body = {"count": len(ids), "max_model_len": self.chat.max_model_len, "tokens": ids}
        if request.return_token_strs:
            # The vocabulary's own strings (as vLLM: "Ġword"), else each token decoded.
            convert = getattr(self.chat.tokenizer, "convert_ids_to_tokens", None)
            body["token_strs"] = (list(convert(ids)) if convert is not None
                                  else [self.chat.token_text(t) for t in ids])
        return body

    def _detokenize(self, request: DetokenizeRequest) -> dict:
        if request.tokens:
            self.chat.check_token_ids(request.tokens, "tokens")
        return {"prompt": self.chat.tokenizer.decode(request.tokens)}
