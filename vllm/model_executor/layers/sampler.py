"""Sampler: logits [N, V] -> one token per row, plus optional logprobs.

Per row: allowed_token_ids, logit_bias, min_tokens masking and penalties, then greedy rows
take the argmax; the others apply temperature, min-p, top-k and top-p, and sample with the
exponential race (`argmax(probs / q)`, q ~ Exp(1)), which needs no host sync. Seeded rows
draw q from their own torch.Generator, so their tokens do not depend on what else is in the
batch.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from vllm.utils.cpu_kernels import load_cpu_extension

_ARGMAX_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc",
                              "cpu_sampling.cpp")


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` for [N, V] logits. Float32 CPU rows go to a C++ kernel
    (csrc/cpu_sampling.cpp, built at first use; VLLM_CPU_SAMPLING_KERNEL=0 turns it off):
    torch's CPU argmax walks a row one element at a time, ~3x slower on a 150k vocabulary."""
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.shape[1] > 0 and logits.stride(1) == 1
            and not torch.compiler.is_compiling()
            and load_cpu_extension("sampling", _ARGMAX_SOURCE, "VLLM_CPU_SAMPLING_KERNEL")):
        return torch.ops.vllm_cpu_sampling.argmax_rows(logits)
    return logits.argmax(dim=-1)


@dataclass
class SamplingMetadata:
    """Per-row sampling inputs (N rows, device tensors unless noted)."""

    temperature: torch.Tensor | None
    """[N] float32; 1.0 on greedy rows (they take the argmax anyway). None when all rows are
    greedy."""
    all_greedy: bool
    all_random: bool
    greedy_mask: torch.Tensor | None = None
    """[N] bool, set when the batch mixes greedy and random rows."""
    top_p: torch.Tensor | None = None
    """[N] float32, None when no row uses top-p."""
    top_k: torch.Tensor | None = None
    """[N] int64 (vocab size = off), None when no row uses top-k."""
    min_p: torch.Tensor | None = None
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    """row -> generator for seeded rows."""
    max_num_logprobs: int | None = None
    """Top-k logprobs to return (the largest any row asked for); None = no logprobs."""
    banned_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
    """(rows, token ids) whose logits are -inf: stop tokens before min_tokens, and the tokens
    bad_words forbid."""
    presence_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    prompt_token_ids: torch.Tensor | None = None
    """[N, P] int64 padded with the vocab size (penalties only)."""
    output_token_ids: torch.Tensor | None = None
    """[N, O] int64 padded with the vocab size (penalties only)."""
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    """(rows, token ids, values) added to the logits."""
    allowed_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
    """(rows [R], mask [R, V] bool): in these rows only the masked-in tokens can be sampled."""

    @property
    def no_penalties(self) -> bool:
        return self.repetition_penalties is None


@dataclass
class LogprobsTensors:
    """[N, k + 1]: column 0 is the sampled (or target) token, then the top-k; ranks are
    1-based ranks in the vocabulary."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor
    """[N] int64."""
    logprobs_tensors: LogprobsTensors | None


class Sampler(nn.Module):

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        # Logprobs are those of the model's raw distribution (upstream's default).
        raw_logprobs = (logits.log_softmax(dim=-1) if metadata.max_num_logprobs is not None
                        else None)
        if metadata.allowed_tokens is not None:
            rows, allowed = metadata.allowed_tokens
            logits = logits.index_put((rows,), logits[rows].masked_fill(~allowed, float("-inf")))
        if metadata.logit_bias is not None:
            rows, cols, values = metadata.logit_bias
            logits = logits.index_put((rows, cols), values, accumulate=True)
        if metadata.banned_tokens is not None:
            rows, cols = metadata.banned_tokens
            logits = logits.index_put((rows, cols), torch.tensor(float("-inf"),
                                                                 device=logits.device))
        if not metadata.no_penalties:
            logits = apply_penalties(logits, metadata)
        sampled = self.sample(logits, metadata)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, metadata.max_num_logprobs, sampled)
        return SamplerOutput(sampled, logprobs)

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        greedy = greedy_argmax(logits) if not metadata.all_random else None
        if metadata.all_greedy:
            return greedy
        assert metadata.temperature is not None, "a batch with random rows needs temperatures"
        logits = logits / metadata.temperature.unsqueeze(1)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        logits = apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        probs = logits.softmax(dim=-1)
        random = random_sample(probs, metadata.generators)
        if greedy is None:
            return random
        return torch.where(metadata.greedy_mask, greedy, random)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Exponential race: argmax(p / q) with q ~ Exp(1) draws from p."""
    q = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    return greedy_argmax(probs.div(q))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep each row's top_k tokens and its smallest set with probability >= top_p."""
    if top_k is None and top_p is None:
        return logits
    vocab_size = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        kth = (vocab_size - top_k).clamp(min=0, max=vocab_size - 1).unsqueeze(1)
        threshold = sorted_logits.gather(1, kth)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < threshold, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False  # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, L] ids padded with vocab_size -> [N, V] occurrence counts."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.int64,
                         device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition penalty over prompt + output tokens (divide positive logits, multiply
    negative ones); frequency and presence penalties over output tokens (OpenAI's)."""
    vocab_size = logits.shape[-1]
    output_counts = _token_counts(metadata.output_token_ids, vocab_size)
    prompt_seen = _token_counts(metadata.prompt_token_ids, vocab_size) > 0
    seen = prompt_seen | (output_counts > 0)
    rep = metadata.repetition_penalties.unsqueeze(1).expand_as(logits)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - metadata.frequency_penalties.unsqueeze(1) * output_counts
    logits = logits - metadata.presence_penalties.unsqueeze(1) * (output_counts > 0)
    return logits


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int,
                    token_ids: torch.Tensor) -> LogprobsTensors:
    """The logprob and rank of `token_ids` [N] plus the top `num_logprobs` of each row."""
    token_ids = token_ids.long().unsqueeze(1)
    token_logprobs = logprobs.gather(1, token_ids)
    token_ranks = (logprobs > token_logprobs).sum(dim=-1, keepdim=True) + 1
    if num_logprobs > 0:
        top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
        top_ranks = torch.arange(1, num_logprobs + 1, device=logprobs.device).expand(
            logprobs.shape[0], -1)
        return LogprobsTensors(torch.cat([token_ids, top_ids], dim=1),
                               torch.cat([token_logprobs, top_logprobs], dim=1),
                               torch.cat([token_ranks, top_ranks], dim=1))
    return LogprobsTensors(token_ids, token_logprobs, token_ranks)
