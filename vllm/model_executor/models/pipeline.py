"""Pipeline parallelism for the decoder stacks: which layers a stage holds, placeholders for
the others, and the hand-over of hidden states and residuals between stages.

Split rule (`get_pp_indices`): stage s of P holds layers [start, end). Without
VLLM_PP_LAYER_PARTITION each stage gets num_layers // P layers and the remainder R goes one
layer each to the R stages just before the last (the last stage also runs the final norm,
the LM head and sampling, so it never gets an extra layer; the first stage, which embeds,
only when R = P - 1). Examples: 10 layers on 4 stages -> 2, 3, 3, 2; 5 on 3 -> 2, 2, 1; 24
on 2 -> 12, 12. VLLM_PP_LAYER_PARTITION="a,b,..." (one positive count per stage, summing to
num_layers) sets the split explicitly, e.g. "4,4".

A model supports pipeline parallelism when its `*Model` builds its layers with `make_layers`,
its embedding only on the first stage and its final norm only on the last, and takes
`(input_ids, positions, hidden_states, residual)`: the first stage embeds, the others start
from the received tensors; every stage but the last returns `(hidden_states, residual)`.
`pp_forward` (in the `*ForCausalLM`'s uncompiled forward) receives and sends around the
compiled stack, so each stage compiles its own graph.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

PP_PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the layers stage `pp_rank` of `pp_size` holds (rule in the module
    docstring). ValueError for a split that leaves a stage empty or does not add up."""
    return pp_partition(num_layers, pp_size)[pp_rank]


def pp_partition(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """Every stage's [start, end) of the layers."""
    from vllm import envs

    text = envs.VLLM_PP_LAYER_PARTITION
    if text:
        try:
            counts = [int(part) for part in text.split(",")]
        except ValueError:
            raise ValueError(f"{PP_PARTITION_ENV}={text!r} must be comma-separated layer "
                             "counts, one per pipeline stage, e.g. '4,4'") from None
        if len(counts) != pp_size:
            raise ValueError(f"{PP_PARTITION_ENV}={text!r} names {len(counts)} stages; "
                             f"pipeline_parallel_size is {pp_size}")
        if any(c < 1 for c in counts):
            raise ValueError(f"{PP_PARTITION_ENV}={text!r}: every stage needs at least one "
                             "layer")
        if sum(counts) != num_layers:
            raise ValueError(f"{PP_PARTITION_ENV}={text!r} sums to {sum(counts)} layers; the "
                             f"model has {num_layers}")
    else:
        if pp_size > num_layers:
            raise ValueError(f"pipeline_parallel_size={pp_size} is more than the model's "
                             f"{num_layers} layers (each stage needs at least one)")
        counts = [num_layers // pp_size] * pp_size
        for i in range(num_layers % pp_size):
            counts[-2 - i] += 1
    bounds, start = [], 0
    for c in counts:
        bounds.append((start, start + c))
        start += c
    return bounds


class PPMissingLayer(nn.Identity):
    """Stands for a layer (or embedding, norm, head) another stage holds: no parameters, so
    the module tree keeps its names (`layers.17`) and the weights of other stages are
    skipped when loading."""


def pp_state() -> tuple[int, int]:
    """(this rank's stage, number of stages)."""
    from vllm.distributed.parallel_state import get_pp_group

    group = get_pp_group()
    return group.rank_in_group, group.world_size


def make_layers(num_layers: int, build: Callable[[int], nn.Module]
                ) -> tuple[int, int, nn.ModuleList]:
    """(start, end, layers): `build(i)` for this stage's layers, PPMissingLayer for the
    others."""
    rank, size = pp_state()
    start, end = get_pp_indices(num_layers, rank, size) if size > 1 else (0, num_layers)
    return start, end, nn.ModuleList(build(i) if start <= i < end else PPMissingLayer()
                                     for i in range(num_layers))


def is_first_stage() -> bool:
    rank, _ = pp_state()
    return rank == 0


def is_last_stage() -> bool:
    rank, size = pp_state()
    return rank == size - 1


def is_pp_missing_parameter(name: str, model: nn.Module) -> bool:
    """Whether checkpoint tensor `name` belongs to a module this stage does not hold."""
    module = model
    for part in name.split(".")[:-1]:
        if isinstance(module, PPMissingLayer):
            return True
        child = getattr(module, part, None) if not part.isdigit() else (
            module[int(part)] if isinstance(module, nn.ModuleList) and int(part) < len(module)
            else None)
        if child is None:
            return False
        module = child
    return isinstance(module, PPMissingLayer)


def check_pp_supported(model_cls: type, pp_size: int) -> None:
    """ValueError when pipeline parallelism is asked of a family without it."""
    if pp_size > 1 and not getattr(model_cls, "supports_pp", False):
        raise ValueError(f"pipeline_parallel_size={pp_size}: {model_cls.__name__} does not "
                         "support pipeline parallelism (the Llama-style families do: Llama, "
                         "Mistral, Mixtral, Qwen2/3 (MoE), Phi-3, Gemma 1/2/3); use "
                         "tensor_parallel_size instead")


def pp_forward(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
               hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Run this stage of the decoder stack `model`: receive (hidden_states, residual) from
    the previous stage unless first, send them to the next unless last. Returns the last
    stage's hidden states; other stages return their sent hidden states (nothing samples
    from them: `compute_logits` of a non-last stage returns None)."""
    rank, size = pp_state()
    if size == 1:
        return model(input_ids, positions)
    import torch.distributed as dist

    from vllm.distributed.parallel_state import get_pp_group

    group = get_pp_group()
    hidden = residual = None
    if rank > 0:
        shape = (input_ids.shape[0], hidden_size)
        hidden = torch.empty(shape, dtype=dtype, device=input_ids.device)
        residual = torch.empty(shape, dtype=dtype, device=input_ids.device)
        dist.recv(hidden, src=group.prev_rank)
        dist.recv(residual, src=group.prev_rank)
    out = model(input_ids, positions, hidden, residual)
    if rank == size - 1:
        return out
    hidden, residual = out
    wait_pp_sends()
    # Asynchronous: the stage goes on with its next micro-batch while the next stage runs
    # this one (the tensors stay referenced until the sends completed).
    for tensor in (hidden.contiguous(), residual.contiguous()):
        _PENDING_SENDS.append((dist.isend(tensor, dst=group.next_rank), tensor))
    return hidden


_PENDING_SENDS: list[tuple[Any, torch.Tensor]] = []


def wait_pp_sends() -> None:
    """Wait until this stage's sends to the next stage completed (before the next sends and
    at the end of each step)."""
    while _PENDING_SENDS:
        work, _ = _PENDING_SENDS.pop(0)
        work.wait()


def num_micro_batches(pp_size: int, num_reqs: int) -> int:
    """How many micro-batches a step's batch is cut into: VLLM_PP_MICRO_BATCHES if set (e.g.
    the stage count, so that the stages overlap), else 1 (the whole batch, stage by stage);
    never more than requests. The default is measured: on the 2-core dev machine (Qwen2.5-0.5B
    shape in bfloat16, -O2, Ray, batch 16; benchmarks/results/pp_qwen05b.md) PP=2 decoded 21.0
    tok/s stage by stage against 16.4 with two micro-batches (TP=1: 30.6): each micro-batch
    reads the stage's weights again, which the stages' overlap does not pay for on one host."""
    from vllm import envs

    text = envs.VLLM_PP_MICRO_BATCHES
    if text:
        try:
            wanted = int(text)
        except ValueError:
            wanted = 0
        if wanted < 1:
            raise ValueError(f"VLLM_PP_MICRO_BATCHES={text!r} must be a positive integer")
    else:
        wanted = 1
    return max(1, min(wanted, num_reqs))


def split_micro_batches(scheduler_output: Any, pp_size: int) -> list[Any]:
    """The step's SchedulerOutput cut into micro-batches of consecutive requests with about
    equal token counts (each a copy with only `num_scheduled_tokens` and
    `total_num_scheduled_tokens` narrowed: what the runner's input preparation reads). With
    pipeline parallelism every stage runs them in order; stage s works on micro-batch m
    while stage s+1 runs micro-batch m-1, so the stages overlap within one step."""
    import dataclasses

    items = list(scheduler_output.num_scheduled_tokens.items())
    k = num_micro_batches(pp_size, len(items)) if pp_size > 1 else 1
    if k == 1:
        return [scheduler_output]
    total = scheduler_output.total_num_scheduled_tokens
    parts: list[dict[str, int]] = [{}]
    done = 0
    for i, (req_id, n) in enumerate(items):
        left_reqs, left_parts = len(items) - i, k - len(parts)
        # Start the next part when this one has its share, or when every remaining request
        # is needed to give each remaining part one.
        if parts[-1] and left_parts > 0 and (done >= total * len(parts) / k
                                            or left_reqs <= left_parts):
            parts.append({})
        parts[-1][req_id] = n
        done += n
    return [dataclasses.replace(scheduler_output, num_scheduled_tokens=part,
                                total_num_scheduled_tokens=sum(part.values()))
            for part in parts]


def merge_outputs(req_ids: list[str], outputs: list[Any]) -> Any:
    """One ModelRunnerOutput from the micro-batches' (in the step's request order)."""
    import dataclasses

    first = outputs[0]
    merged = dataclasses.replace(first, req_ids=list(req_ids),
                                 sampled_token_ids=dict(first.sampled_token_ids),
                                 logprobs=dict(first.logprobs),
                                 prompt_logprobs=dict(first.prompt_logprobs))
    for out in outputs[1:]:
        merged.sampled_token_ids.update(out.sampled_token_ids)
        merged.logprobs.update(out.logprobs)
        merged.prompt_logprobs.update(out.prompt_logprobs)
    return merged
