"""Random-weight Hugging Face checkpoints of published shapes, written locally for benchmarks."""
from __future__ import annotations

import json
import os

SHAPES = {
    # Qwen2.5-0.5B's published shape (random weights).
    "qwen2.5-0.5b": {"arch": "Qwen2ForCausalLM", "hidden_size": 896, "intermediate_size": 4864,
                     "num_hidden_layers": 24, "num_attention_heads": 14,
                     "num_key_value_heads": 2, "vocab_size": 151936,
                     "max_position_embeddings": 32768, "tie_word_embeddings": True,
                     "rope_theta": 1000000.0, "rms_norm_eps": 1e-6},
    # The 50M Llama of spec/cpu-performance.md.
    "llama-50m": {"arch": "LlamaForCausalLM", "hidden_size": 512, "intermediate_size": 1376,
                  "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8,
                  "vocab_size": 32000, "max_position_embeddings": 2048,
                  "tie_word_embeddings": False, "rms_norm_eps": 1e-5},
    # Gemma-2-2B's per-layer shape and vocabulary (window 4096 on every other layer, both
    # soft-caps), 4 of its 26 layers so that the random checkpoint fits a small machine.
    "gemma2-2b-4l": {"arch": "Gemma2ForCausalLM", "hidden_size": 2304,
                     "intermediate_size": 9216, "num_hidden_layers": 4,
                     "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                     "vocab_size": 256000, "max_position_embeddings": 8192,
                     "sliding_window": 4096, "query_pre_attn_scalar": 256,
                     "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                     "tie_word_embeddings": True, "rms_norm_eps": 1e-6},
    # Qwen3-30B-A3B's per-layer shape (hidden 2048, 32/4 heads of 128, experts of 768, top 8,
    # normalised) and vocabulary, with 4 of its 48 layers and 32 of its 128 experts.
    "qwen3-moe-4l": {"arch": "Qwen3MoeForCausalLM", "hidden_size": 2048,
                     "intermediate_size": 6144, "moe_intermediate_size": 768,
                     "num_hidden_layers": 4, "num_attention_heads": 32,
                     "num_key_value_heads": 4, "head_dim": 128, "num_experts": 32,
                     "num_experts_per_tok": 8, "norm_topk_prob": True,
                     "decoder_sparse_step": 1, "vocab_size": 151936,
                     "max_position_embeddings": 32768, "tie_word_embeddings": False,
                     "rope_theta": 1000000.0, "rms_norm_eps": 1e-6},
}


def write_checkpoint(name: str, root: str, seed: int = 0) -> str:
    """Write (once) a random-weight checkpoint of shape `name` under `root`; return its path."""
    import torch
    import transformers

    path = os.path.join(root, name)
    if os.path.isfile(os.path.join(path, "model.safetensors")) or os.path.isfile(
            os.path.join(path, "model.safetensors.index.json")):
        return path
    shape = dict(SHAPES[name])
    arch = shape.pop("arch")
    # Qwen2ForCausalLM -> Qwen2Config, Gemma2ForCausalLM -> Gemma2Config, ...
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    config = config_cls(**shape, architectures=[arch], torch_dtype="float32")
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config)
    with torch.no_grad():  # keep activations in a sane range with random weights
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.02)
    model.save_pretrained(path, safe_serialization=True)
    _write_byte_tokenizer(path, config.vocab_size)
    return path


def model_path(name: str, root: str) -> str:
    """What to load for shape `name`: "demo" is the built-in demo model (smoke runs), any other
    shape its checkpoint under `root` (`write_checkpoint`)."""
    return "demo" if name == "demo" else write_checkpoint(name, root)


def _write_byte_tokenizer(path: str, vocab_size: int) -> None:
    """A byte-level BPE tokenizer (trained on a little stdlib text) so the folder is complete."""
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = sysconfig.get_paths()["stdlib"]
    texts = [open(os.path.join(stdlib, f), encoding="utf-8").read()
             for f in ("argparse.py", "json/decoder.py", "textwrap.py")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, 2048), special_tokens=["</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", bos_token="</s>")
    fast.save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": fast.eos_token_id}, f)
