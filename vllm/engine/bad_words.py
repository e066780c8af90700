"""bad_words: which tokens the words forbid next, in time independent of the number of words.

A word is banned as token sequences (the word as written and with a leading space): its last
token is forbidden wherever the output so far ends with its other tokens. `BadWordsIndex` is a
trie over those prefixes read backwards from the last output token, so a step walks back only
as far as the output keeps matching some prefix (usually zero or one token), instead of
comparing every word's prefix with the output's tail.
"""
from __future__ import annotations

from typing import Any


class BadWordsIndex:
    """A node of the index: `banned` holds the last tokens of the words whose prefix is the
    path from the root, read backwards (at the root: one-token words, banned everywhere)."""

    __slots__ = ("banned", "children")

    def __init__(self) -> None:
        self.banned: set[int] = set()
        self.children: dict[int, BadWordsIndex] = {}

    @classmethod
    def build(cls, sequences: list[list[int]]) -> BadWordsIndex:
        """The index of non-empty token sequences."""
        root = cls()
        for seq in sequences:
            node = root
            for token in reversed(seq[:-1]):
                node = node.children.setdefault(token, cls())
            node.banned.add(seq[-1])
        return root

    def banned_after(self, token_ids: list[int], start: int = 0) -> set[int]:
        """The tokens forbidden after the output `token_ids[start:]` (a prefix must lie
        within it). Costs the length of the longest matching prefix."""
        node, banned = self, set(self.banned)
        for i in range(len(token_ids) - 1, start - 1, -1):
            node = node.children.get(token_ids[i])
            if node is None:
                break
            banned |= node.banned
        return banned


def encode_all(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of each text without special tokens: one batch call where the tokenizer
    takes a batch (transformers' tokenizers are callable on a list), else one encode() per
    text."""
    if not texts:
        return []
    if callable(tokenizer):
        encoded = tokenizer(texts, add_special_tokens=False)
        ids = encoded if isinstance(encoded, list) else encoded["input_ids"]
        return [list(x) for x in ids]
    return [list(tokenizer.encode(text, add_special_tokens=False)) for text in texts]
