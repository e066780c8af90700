"""The committed demo model folder (vllm/demo_model) is a complete, small Hugging Face folder."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

DEMO_DIR = Path(
    os.environ.get("VLLM_TEST_DEMO_MODEL_DIR")
    or Path(__file__).resolve().parents[2] / "vllm" / "demo_model"
)
REQUIRED = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "README.md",
    "eval.json",
    "heldout_sample.txt",
]
MAX_BYTES = 20 * 1000 * 1000

SNIPPET = (
    "import os\n\n\nclass Foo(Bar):\n"
    '    """Docstring with unicode: é, ß, → and a tab\there."""\n\n'
    "    def __init__(self, x=1, *args, **kwargs):\n"
    "        self.x = x  # comment\n"
    "        return None\n"
)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(DEMO_DIR))


@pytest.fixture(scope="module")
def eval_info():
    return json.loads((DEMO_DIR / "eval.json").read_text())


def test_files_exist_and_size():
    for name in REQUIRED:
        assert (DEMO_DIR / name).is_file(), name
    total = sum(p.stat().st_size for p in DEMO_DIR.rglob("*") if p.is_file())
    assert total <= MAX_BYTES, total


def test_safetensors_is_real_float32_file():
    from safetensors import safe_open

    head = (DEMO_DIR / "model.safetensors").read_bytes()[:64]
    assert not head.startswith(b"version https://git-lfs"), "model.safetensors is an LFS pointer"
    with safe_open(str(DEMO_DIR / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        assert "model.embed_tokens.weight" in names
        assert any(n.startswith("model.layers.0.self_attn.q_proj") for n in names)
        for n in names:
            assert f.get_slice(n).get_dtype() == "F32", n


def test_config_loads():
    from transformers import AutoConfig

    raw = json.loads((DEMO_DIR / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLM"]
    assert raw["torch_dtype"] == "float32"
    cfg = AutoConfig.from_pretrained(str(DEMO_DIR))
    assert cfg.model_type == "llama"
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    assert cfg.bos_token_id == 0 and cfg.eos_token_id == 1
    gen = json.loads((DEMO_DIR / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg.eos_token_id


def test_tokenizer_round_trip(tokenizer):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(DEMO_DIR))
    assert len(tokenizer) == cfg.vocab_size
    assert tokenizer.bos_token == "<s>" and tokenizer.eos_token == "</s>"
    assert tokenizer.unk_token == "<unk>"
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1)
    ids = tokenizer(SNIPPET)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and tokenizer.bos_token_id not in ids[1:]
    assert all(0 <= i < cfg.vocab_size for i in ids)
    assert tokenizer.decode(ids, skip_special_tokens=True) == SNIPPET
    plain = tokenizer(SNIPPET, add_special_tokens=False)["input_ids"]
    assert plain == ids[1:]
    # BPE learned Python: much fewer tokens than bytes.
    assert len(plain) < len(SNIPPET.encode("utf-8")) / 2


def test_chat_template(tokenizer):
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "def add(a, b):"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s>system: You write Python.\nuser: def add(a, b):\nassistant:"
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    assert no_prompt == "<s>system: You write Python.\nuser: def add(a, b):\n"
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.bos_token_id) == 1


def test_eval_json(eval_info):
    for key in ("perplexity", "heldout_sample_perplexity"):
        ppl = eval_info[key]
        assert isinstance(ppl, float) and math.isfinite(ppl) and 1.0 < ppl < 100.0, (key, ppl)
    assert eval_info["context_length"] > 0
    assert eval_info["num_tokens_evaluated"] > 10_000
    assert eval_info["heldout_files"] and "heldout_rule" in eval_info
    sample = (DEMO_DIR / "heldout_sample.txt").read_bytes()
    assert 20_000 <= len(sample) <= 50_000
    sample.decode("utf-8")


def test_heldout_sample_perplexity_matches_transformers(tokenizer, eval_info):
    """Recompute the recorded heldout_sample perplexity with the documented windowing."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(DEMO_DIR), dtype=torch.float32).eval()
    text = (DEMO_DIR / "heldout_sample.txt").read_text(encoding="utf-8")
    ids = tokenizer(text)["input_ids"]
    ctx = eval_info["context_length"]
    nll, n = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(ids), ctx):
            w = torch.tensor(ids[s : s + ctx])
            if w.numel() < 2:
                break
            logp = model(input_ids=w[None]).logits[0, :-1].float().log_softmax(-1)
            nll -= logp.gather(1, w[1:, None]).double().sum().item()
            n += w.numel() - 1
    assert n == eval_info["heldout_sample_num_tokens_evaluated"]
    assert math.exp(nll / n) == pytest.approx(eval_info["heldout_sample_perplexity"], rel=1e-3)
