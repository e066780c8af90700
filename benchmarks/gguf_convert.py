"""Write a Hugging Face Llama or Qwen2 checkpoint as a GGUF file that llama.cpp loads.

A small converter for the benchmarks' random-weight checkpoints (benchmarks/checkpoints.py):
float32 or bfloat16 tensors (1-D norms and biases stay float32, as llama.cpp keeps them), the
byte-level BPE tokenizer from tokenizer.json (padded with unused tokens to the model's vocab
size). Needs the `gguf` package (`pip install -e '.[bench]'`).

    python benchmarks/gguf_convert.py CHECKPOINT_DIR OUT.gguf --dtype bfloat16
"""
from __future__ import annotations

import argparse
import json
import os

# config.json architectures -> llama.cpp's architecture name
ARCHES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
DTYPES = ("float32", "bfloat16")

# Hugging Face per-layer tensor name suffix -> GGUF per-block name
LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL_TENSORS = {"model.embed_tokens.weight": "token_embd.weight",
                  "model.norm.weight": "output_norm.weight",
                  "lm_head.weight": "output.weight"}


def load_state_dict(path: str) -> dict:
    """Every tensor of the checkpoint folder's safetensors file(s), by name."""
    from safetensors.torch import load_file

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state: dict = {}
    for name in files:
        state.update(load_file(os.path.join(path, name)))
    return state


def rope_theta(config: dict) -> float:
    """rope_theta from config.json (transformers 5 nests it under rope_parameters)."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind != "default":
        raise ValueError(f"rope type {kind!r} is not supported by this converter; only "
                         "'default' (plain RoPE) is")
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


def interleave_rope_rows(weight, n_head: int):
    """Reorder q/k projection rows from Hugging Face's rotate-half RoPE layout (the pairs are
    (i, i + d/2)) to the adjacent-pairs layout (2i, 2i + 1) that llama.cpp's "llama"
    architecture rotates."""
    rows = weight.shape[0]
    return (weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def tokenizer_fields(path: str, vocab_size: int) -> dict:
    """tokens, token types, merges and special ids from tokenizer.json, padded to vocab_size."""
    import gguf

    with open(os.path.join(path, "tokenizer.json"), encoding="utf-8") as f:
        data = json.load(f)
    model = data["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"tokenizer model {model.get('type')!r} is not supported; only 'BPE' "
                         "(byte-level) is")
    by_id: dict[int, str] = {i: t for t, i in model["vocab"].items()}
    types: dict[int, int] = {i: int(gguf.TokenType.NORMAL) for i in by_id}
    for added in data.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
        types[added["id"]] = int(gguf.TokenType.CONTROL if added.get("special")
                                 else gguf.TokenType.USER_DEFINED)
    if by_id and max(by_id) >= vocab_size:
        raise ValueError(f"tokenizer id {max(by_id)} does not fit the model's vocab_size "
                         f"{vocab_size}")
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    token_types = [types.get(i, int(gguf.TokenType.UNUSED)) for i in range(vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    special = {}
    config_file = os.path.join(path, "tokenizer_config.json")
    token_config = json.load(open(config_file)) if os.path.isfile(config_file) else {}
    ids = {t: i for i, t in by_id.items()}
    for key in ("bos_token", "eos_token", "pad_token"):
        tok = token_config.get(key)
        if isinstance(tok, dict):
            tok = tok.get("content")
        if tok in ids:
            special[key] = ids[tok]
    return {"tokens": tokens, "types": token_types, "merges": merges, "special": special}


def convert(path: str, out: str, dtype: str = "float32") -> str:
    """Write the checkpoint folder `path` as a GGUF file `out` with 2-D weights in `dtype`
    ("float32" or "bfloat16"); return `out`."""
    import gguf
    import torch

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {DTYPES}")
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    archs = config.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHES:
        raise ValueError(f"architecture {archs!r} is not supported; use one of "
                         f"{sorted(ARCHES)}")
    arch = ARCHES[archs[0]]
    n_head = config["num_attention_heads"]
    n_kv = config.get("num_key_value_heads") or n_head
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // n_head
    vocab = config["vocab_size"]

    writer = gguf.GGUFWriter(out, arch)
    writer.add_name(os.path.basename(os.path.normpath(path)))
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(hidden)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != hidden // n_head:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_freq_base(rope_theta(config))
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-6))
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "float32"
                         else gguf.LlamaFileType.MOSTLY_BF16)

    tok = tokenizer_fields(path, vocab)
    writer.add_tokenizer_model("gpt2")  # byte-level BPE
    writer.add_tokenizer_pre("gpt-2")   # GPT-2's pre-tokenizer regex (ByteLevel use_regex)
    writer.add_token_list(tok["tokens"])
    writer.add_token_types(tok["types"])
    writer.add_token_merges(tok["merges"])
    if "bos_token" in tok["special"]:
        writer.add_bos_token_id(tok["special"]["bos_token"])
    if "eos_token" in tok["special"]:
        writer.add_eos_token_id(tok["special"]["eos_token"])
    if "pad_token" in tok["special"]:
        writer.add_pad_token_id(tok["special"]["pad_token"])
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)

    state = load_state_dict(path)
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # llama.cpp reads token_embd as the output matrix
    for name, tensor in state.items():
        if name in GLOBAL_TENSORS:
            gguf_name = GLOBAL_TENSORS[name]
        else:
            parts = name.split(".")  # model.layers.<i>.<suffix>
            suffix = ".".join(parts[3:])
            if parts[:2] != ["model", "layers"] or suffix not in LAYER_TENSORS:
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                raise ValueError(f"tensor {name!r} has no GGUF name in this converter")
            gguf_name = f"blk.{parts[2]}.{LAYER_TENSORS[suffix]}"
        tensor = tensor.detach().to(torch.float32)
        if arch == "llama" and suffix_is(name, "q_proj"):
            tensor = interleave_rope_rows(tensor, n_head)
        elif arch == "llama" and suffix_is(name, "k_proj"):
            tensor = interleave_rope_rows(tensor, n_kv)
        if dtype == "bfloat16" and tensor.dim() >= 2:
            raw = tensor.to(torch.bfloat16).contiguous().view(torch.uint8).numpy()
            writer.add_tensor(gguf_name, raw, raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(gguf_name, tensor.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def suffix_is(name: str, proj: str) -> bool:
    return name.endswith(f"self_attn.{proj}.weight") or name.endswith(f"self_attn.{proj}.bias")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    args = parser.parse_args()
    print(convert(args.checkpoint, args.out, args.dtype))


if __name__ == "__main__":
    main()
