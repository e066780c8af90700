"""Prompt shapes the engine accepts besides a plain string (upstream's `vllm.inputs` names):
`TextPrompt` ({"prompt": text}) and `TokensPrompt` ({"prompt_token_ids": [...]}, optionally
with the text). Plain dicts of the same shape work as well."""
from __future__ import annotations

from typing import TypedDict

from typing_extensions import NotRequired

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]


PromptType = str | TextPrompt | TokensPrompt
