"""POST /tokenize and /detokenize (vLLM's endpoints): the server's own tokenizer and chat
template, so that a client counts tokens exactly as the completions it sends will."""
from __future__ import annotations

from vllm.entrypoints.openai.protocol import DetokenizeRequest, OpenAIError, TokenizeRequest
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat


class OpenAIServingTokenization:
    """Tokenizes with the chat handler's tokenizer and template (one per server)."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    def tokenize(self, request: TokenizeRequest) -> dict:
        """{"count", "max_model_len", "tokens"} (+ "token_strs" when asked); 400 unless
        exactly one of prompt and messages is given."""
        self.chat.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError("give either prompt or messages", 400, "prompt")
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

    def detokenize(self, request: DetokenizeRequest) -> dict:
        """{"prompt": text}; 400 naming `tokens` for an id outside the vocabulary."""
        self.chat.check_model(request.model)
        if request.tokens:
            self.chat.check_token_ids(request.tokens, "tokens")
        return {"prompt": self.chat.tokenizer.decode(request.tokens)}
