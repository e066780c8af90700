"""Upstream's `vllm.sequence` import path, for code written against it.

Upstream kept `Logprob` and the logprob list types here before moving them to
`vllm.logprobs`; they are re-exported from there (the same objects). Upstream's other
sequence classes (SequenceData, SequenceGroup, IntermediateTensors, ...) belong to engine
internals this engine does not have, so they are not provided.
"""
from __future__ import annotations

from vllm.logprobs import Logprob, LogprobsOnePosition, PromptLogprobs, SampleLogprobs

__all__ = ["Logprob", "LogprobsOnePosition", "PromptLogprobs", "SampleLogprobs"]
