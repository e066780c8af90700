"""End to end: an FP8 random-weight Llama through `vllm.LLM` at -O2 has every FP8 fusion
matched and generates the same greedy tokens as the same model at -O0."""
from __future__ import annotations

import logging

import pytest

from tests.quantization.fp8_checkpoints import make_fp8_llama
from vllm import LLM, SamplingParams
from vllm.compilation.passes.fusion.matcher_utils import fusion_match_counter

PROMPTS = ["The quick brown fox", "Paged attention stores keys and values",
           "Hello world! How are you today?"]
LAYERS = 2


@pytest.fixture(scope="module", autouse=True)
def compiled_llama():
    """Compile LlamaModel with @support_torch_compile (a no-op at -O0) while these tests run,
    unless the model class already carries it."""
    from vllm.compilation.decorators import support_torch_compile
    from vllm.model_executor.models.llama import LlamaModel

    if getattr(LlamaModel, "_vllm_compile_decorated", False):
        yield
        return
    saved = {k: LlamaModel.__dict__[k] for k in ("__init__", "forward")}
    support_torch_compile(LlamaModel)
    yield
    for key, value in saved.items():
        setattr(LlamaModel, key, value)
    del LlamaModel._vllm_compile_decorated


def greedy(n: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)


def generate(path: str, level: int, **kwargs) -> list[list[int]]:
    llm = LLM(model=path, optimization_level=level, max_model_len=256, **kwargs)
    outputs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


# (layout, weights, activations): static per-tensor (all three fusions), dynamic per-token,
# block weights with per-group activations.
CASES = {"static": ("fp8", "tensor", "static"),
         "per-token": ("compressed-tensors", "channel", "dynamic"),
         "group": ("fp8", "block", "dynamic")}
EXPECTED = {"static": {"RMSNormQuantFusionPass": 2 * LAYERS,
                       "ActivationQuantFusionPass": LAYERS, "AttnQuantFusionPass": LAYERS},
            "per-token": {"RMSNormQuantFusionPass": 2 * LAYERS,
                          "ActivationQuantFusionPass": LAYERS},
            "group": {"RMSNormQuantFusionPass": 2 * LAYERS,
                      "ActivationQuantFusionPass": LAYERS}}


@pytest.mark.parametrize("case", list(CASES))
def test_o2_fuses_and_matches_o0(tmp_path, case, caplog):
    layout, weights, activations = CASES[case]
    ckpt = make_fp8_llama(tmp_path / case, layout=layout, weights=weights,
                          activations=activations, dtype="float32")
    reference = generate(ckpt.path, 0)
    before = dict(fusion_match_counter)
    caplog.set_level(logging.INFO, logger="vllm")
    fused = generate(ckpt.path, 2, compilation_config={"backend": "eager"})
    matched = {k: v - before.get(k, 0) for k, v in fusion_match_counter.items()
               if v - before.get(k, 0)}
    assert matched == EXPECTED[case]
    assert "Enabled fusions: norm_quant, act_quant" in caplog.text
    assert "matched nothing" not in caplog.text
    assert fused == reference


def test_o2_inductor_static_fp8(tmp_path, monkeypatch):
    """The same with Inductor (CPU freezing on): patterns match Inductor's IR."""
    # A compile cache of its own: an entry stored by an earlier run would be loaded and the
    # passes would not run at all.
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    ckpt = make_fp8_llama(tmp_path / "ind", layout="fp8", weights="tensor",
                          activations="static", dtype="float32")
    reference = generate(ckpt.path, 0)
    before = dict(fusion_match_counter)
    fused = generate(ckpt.path, 2, compilation_config={"backend": "inductor"})
    # (passes that ran earlier in this process, e.g. another test's, stay in the counter)
    matched = {k: v - before.get(k, 0) for k, v in fusion_match_counter.items()
               if v - before.get(k, 0)}
    assert matched == EXPECTED["static"]
    assert fused == reference


def test_fusions_off_gives_the_same_tokens(tmp_path):
    ckpt = make_fp8_llama(tmp_path / "off", layout="fp8", weights="tensor",
                          activations="static", dtype="float32")
    before = dict(fusion_match_counter)
    unfused = generate(ckpt.path, 2, compilation_config={
        "backend": "eager", "pass_config": {"fuse_norm_quant": False, "fuse_act_quant": False,
                                            "fuse_attn_quant": False}})
    assert dict(fusion_match_counter) == before
    assert unfused == generate(ckpt.path, 0)
