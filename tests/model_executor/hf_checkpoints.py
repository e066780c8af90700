"""Tiny random-weight Hugging Face checkpoints for tests (reusable by every test package).

Each `make_*` writes a complete model folder (config.json, *.safetensors, tokenizer files)
with transformers' own classes, in float32, seeded for determinism, and returns the path:

    path = make_llama(tmp_path / "llama", tie_word_embeddings=True)
    path = make_llama(tmp_path / "sharded", max_shard_size="40KB")   # index + several shards
    path = make_llama(tmp_path / "l3", rope_scaling=LLAMA3_ROPE_SCALING)

Keyword overrides go to the transformers config class. `tokenizer=False` skips the tokenizer.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 384,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "initializer_range": 0.1,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}

LLAMA3_ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

# Qwen-style YaRN: a 128-token pre-training context stretched 4x (= max_position_embeddings).
YARN_ROPE_SCALING = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2 (match TINY's pad/bos/eos ids)

CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}\n{{ message['content'] }}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}")

_TEXT = """\
The quick brown fox jumps over the lazy dog while the cat watches from the window.
A language model predicts the next token from the tokens that came before it.
Paged attention stores keys and values in fixed-size blocks, so memory is not wasted.
Continuous batching adds new requests to the running batch as soon as others finish.
Chunked prefill splits a long prompt into pieces that share a step with decodes.
Numbers like 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 and symbols like + - * / = ( ) [ ] { } .
The scheduler decides which requests run in each step under a budget of tokens.
Hello world! How are you today? I am fine, thank you. What is the capital of France?
Paris is the capital of France, Berlin of Germany, Rome of Italy and Madrid of Spain.
def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n
"""


def _settings(overrides: dict[str, Any]) -> dict[str, Any]:
    settings = dict(TINY)
    settings.update(overrides)
    return settings


def _save(model_cls: Any, config: Any, path: Any, seed: int, max_shard_size: str | None,
          tokenizer: bool) -> str:
    path = str(path)
    os.makedirs(path, exist_ok=True)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    if tokenizer:
        make_tokenizer(path, config.vocab_size)
    return path


def make_llama(path: Any, *, seed: int = 0, max_shard_size: str | None = None,
               tokenizer: bool = True, **overrides: Any) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    return _save(LlamaForCausalLM, LlamaConfig(**_settings(overrides)), path, seed,
                 max_shard_size, tokenizer)


def make_qwen2(path: Any, *, seed: int = 0, max_shard_size: str | None = None,
               tokenizer: bool = True, **overrides: Any) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _save(Qwen2ForCausalLM, Qwen2Config(**_settings(overrides)), path, seed,
                 max_shard_size, tokenizer)


def make_qwen3(path: Any, *, seed: int = 0, max_shard_size: str | None = None,
               tokenizer: bool = True, **overrides: Any) -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    settings = _settings({"head_dim": 16, **overrides})
    return _save(Qwen3ForCausalLM, Qwen3Config(**settings), path, seed, max_shard_size,
                 tokenizer)


def make_mixtral(path: Any, *, seed: int = 0, max_shard_size: str | None = None,
                 tokenizer: bool = True, **overrides: Any) -> str:
    from transformers import MixtralConfig, MixtralForCausalLM

    settings = _settings({"intermediate_size": 96, "num_local_experts": 4,
                          "num_experts_per_tok": 2, **overrides})
    return _save(MixtralForCausalLM, MixtralConfig(**settings), path, seed, max_shard_size,
                 tokenizer)


def make_tokenizer(path: Any, vocab_size: int = 384) -> str:
    """A byte-level BPE tokenizer trained on a few KB of text (every byte is encodable), with
    <pad>=0, <s>=1, </s>=2 and a tiny chat template, saved as a HF tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"a byte-level tokenizer needs vocab_size >= "
                         f"{256 + len(SPECIAL_TOKENS)}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([_TEXT] * 8, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return str(path)


def make_mistral(path: Any, *, seed: int = 0, max_shard_size: str | None = None,
                 tokenizer: bool = True, **overrides: Any) -> str:
    from transformers import MistralConfig, MistralForCausalLM

    settings = _settings({"sliding_window": None, "head_dim": 16, **overrides})
    return _save(MistralForCausalLM, MistralConfig(**settings), path, seed, max_shard_size,
                 tokenizer)


def _make_family(config_name: str, model_name: str, defaults: dict[str, Any], path: Any,
                 seed: int, max_shard_size: str | None, tokenizer: bool,
                 overrides: dict[str, Any], base: dict[str, Any] | None = None) -> str:
    """A checkpoint of transformers' `model_name` with `config_name(**settings)`: TINY (or
    `base`), then the family's `defaults`, then the caller's `overrides`."""
    import transformers

    settings = dict(TINY if base is None else base)
    settings.update(defaults)
    settings.update(overrides)
    config = getattr(transformers, config_name)(**settings)
    return _save(getattr(transformers, model_name), config, path, seed, max_shard_size,
                 tokenizer)


# GPT-2 and OPT name their sizes differently from TINY; the same tiny shapes.
_GPT2_TINY = {"vocab_size": 384, "n_positions": 512, "n_embd": 64, "n_layer": 2, "n_head": 4,
              "initializer_range": 0.1, "bos_token_id": 1, "eos_token_id": 2}
_OPT_TINY = {"vocab_size": 384, "hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "max_position_embeddings": 512, "init_std": 0.1,
             "word_embed_proj_dim": 64, "pad_token_id": 0, "bos_token_id": 1,
             "eos_token_id": 2}


def make_gpt2(path: Any, *, seed: int = 0, max_shard_size: str | None = None,
              tokenizer: bool = True, **overrides: Any) -> str:
    return _make_family("GPT2Config", "GPT2LMHeadModel", {}, path, seed, max_shard_size,
                        tokenizer, overrides, base=_GPT2_TINY)


def make_opt(path: Any, *, seed: int = 0, max_shard_size: str | None = None,
             tokenizer: bool = True, **overrides: Any) -> str:
    return _make_family("OPTConfig", "OPTForCausalLM", {}, path, seed, max_shard_size,
                        tokenizer, overrides, base=_OPT_TINY)


def make_gemma(path: Any, *, seed: int = 0, max_shard_size: str | None = None,
               tokenizer: bool = True, **overrides: Any) -> str:
    return _make_family("GemmaConfig", "GemmaForCausalLM",
                        {"head_dim": 16, "hidden_activation": "gelu_pytorch_tanh"}, path, seed,
                        max_shard_size, tokenizer, overrides)


def make_gemma2(path: Any, *, seed: int = 0, max_shard_size: str | None = None,
                tokenizer: bool = True, **overrides: Any) -> str:
    # A window shorter than the tests' prompts, both soft-caps low enough to bite.
    return _make_family("Gemma2Config", "Gemma2ForCausalLM",
                        {"head_dim": 16, "sliding_window": 8, "attn_logit_softcapping": 5.0,
                         "final_logit_softcapping": 3.0, "query_pre_attn_scalar": 24},
                        path, seed, max_shard_size, tokenizer, overrides)


def make_gemma3(path: Any, *, seed: int = 0, max_shard_size: str | None = None,
                tokenizer: bool = True, **overrides: Any) -> str:
    # sliding_window_pattern 2: layer 0 local (window 8, local rope base), layer 1 global.
    return _make_family("Gemma3TextConfig", "Gemma3ForCausalLM",
                        {"head_dim": 16, "sliding_window": 8, "sliding_window_pattern": 2,
                         "query_pre_attn_scalar": 24, "rope_local_base_freq": 10000.0,
                         "rope_theta": 1000000.0},
                        path, seed, max_shard_size, tokenizer, overrides)


def make_phi3(path: Any, *, seed: int = 0, max_shard_size: str | None = None,
              tokenizer: bool = True, **overrides: Any) -> str:
    return _make_family("Phi3Config", "Phi3ForCausalLM",
                        {"pad_token_id": 0, "original_max_position_embeddings": 512}, path,
                        seed, max_shard_size, tokenizer, overrides)


def make_qwen2_moe(path: Any, *, seed: int = 0, max_shard_size: str | None = None,
                   tokenizer: bool = True, **overrides: Any) -> str:
    return _make_family("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                         "shared_expert_intermediate_size": 48, "decoder_sparse_step": 1,
                         "norm_topk_prob": False},
                        path, seed, max_shard_size, tokenizer, overrides)


def make_qwen3_moe(path: Any, *, seed: int = 0, max_shard_size: str | None = None,
                   tokenizer: bool = True, **overrides: Any) -> str:
    return _make_family("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                        {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                         "moe_intermediate_size": 32, "decoder_sparse_step": 1,
                         "norm_topk_prob": True},
                        path, seed, max_shard_size, tokenizer, overrides)


MAKERS = {"llama": make_llama, "qwen2": make_qwen2, "qwen3": make_qwen3,
          "mixtral": make_mixtral, "mistral": make_mistral, "gpt2": make_gpt2, "opt": make_opt,
          "gemma": make_gemma, "gemma2": make_gemma2, "gemma3": make_gemma3, "phi3": make_phi3,
          "qwen2_moe": make_qwen2_moe, "qwen3_moe": make_qwen3_moe}


def randomize_norm_weights(path: str, seed: int = 0) -> None:
    """Give every `*norm.weight` of the checkpoint random values (std 0.5)."""
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in tensors.items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.randn(tensor.shape, generator=generator) * 0.5
    save_file(tensors, file, metadata={"format": "pt"})


def lazy_checkpoints(root: Any, overrides: dict[str, dict[str, Any]] | None = None
                     ) -> Callable[[str], str]:
    """For module-scoped fixtures: name -> the path of a `MAKERS[name]` checkpoint under
    `root` (config overrides from `overrides[name]`), made on first use and then reused."""
    made: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in made:
            made[name] = MAKERS[name](root / name, **(overrides or {}).get(name, {}))
        return made[name]

    return get
