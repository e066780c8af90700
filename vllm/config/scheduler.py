"""Scheduler settings: the per-step token budget and how many sequences run at once."""
from __future__ import annotations

from dataclasses import InitVar, dataclass

from vllm.config.utils import hash_fields, raises_validation_error


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int | None = None
    """Tokens processed per engine step (prefill chunks + decodes). None = platform default."""
    max_num_seqs: int | None = None
    """Sequences running at once. None = platform default."""
    max_model_len: int | None = None
    """Copied from the model config once that is resolved."""
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    """Cap on one request's prefill chunk per step (0 = no cap beyond the budget)."""
    is_encoder_decoder: InitVar[bool] = False
    """Upstream's init-only flag; only decoder-only models run here, so True is an error."""

    @classmethod
    def default_factory(cls, **kwargs) -> SchedulerConfig:
        """A scheduler config with every value not given left to the platform default
        (upstream's constructor for configs built outside `EngineArgs`)."""
        return cls(**kwargs)

    @raises_validation_error
    def __post_init__(self, is_encoder_decoder: bool = False) -> None:
        if is_encoder_decoder:
            raise ValueError("is_encoder_decoder=True: encoder-decoder models are not "
                             "supported by this engine (decoder-only models only)")
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value <= 0):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0, got "
                             f"{self.long_prefill_token_threshold}")

    def compute_hash(self) -> str:
        # The token budget bounds the dynamic compile range, so it is part of the graph key.
        return hash_fields(self, exclude=("max_num_seqs", "long_prefill_token_threshold",
                                          "enable_chunked_prefill"))
