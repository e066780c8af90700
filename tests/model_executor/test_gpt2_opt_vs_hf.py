"""GPT-2 and OPT give transformers' logits over the paged KV cache (prefill, chunked prefill
with cached context, decode, padding lanes) for their config variants and checkpoint
layouts; TP=2 on the CPU gives the TP=1 logits; the forward traces as one Dynamo graph with
one attention op per layer."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.model_executor.hf_checkpoints import make_gpt2, make_opt
from tests.model_executor.paged_runner import PagedRunner
from tests.model_executor.test_models_vs_hf import build, hf_logits, random_tokens, run_scenario
from tests.model_executor.test_tp_and_tracing import free_port, run_steps
from vllm.config import ModelConfig, ParallelConfig, VllmConfig
from vllm.model_executor.model_loader import get_model

MAKERS = {"gpt2": make_gpt2, "opt": make_opt}


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(family, **config overrides) -> a checkpoint folder, made once per module."""
    root = tmp_path_factory.mktemp("gpt2_opt")
    made: dict[str, str] = {}

    def get(family: str, **overrides) -> str:
        key = family + json.dumps(overrides, sort_keys=True)
        if key not in made:
            made[key] = MAKERS[family](root / f"{family}-{len(made)}", tokenizer=False,
                                       **overrides)
        return made[key]

    return get


def rewrite_names(src: str, dst, rename, extra: dict[str, torch.Tensor] | None = None) -> str:
    """A copy of the checkpoint folder `src` at `dst` with every tensor name passed through
    `rename` (None drops the tensor) and `extra` tensors added."""
    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    renamed = {rename(name): tensor.contiguous() for name, tensor in tensors.items()
               if rename(name) is not None}
    renamed.update(extra or {})
    save_file(renamed, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = f.read()
    with open(os.path.join(dst, "config.json"), "w") as f:
        f.write(config)
    return str(dst)


# ---------------------------------------------------------------- GPT-2

@pytest.mark.parametrize("block_size", [16, 4])
def test_gpt2_default(checkpoints, block_size):
    path = checkpoints("gpt2")
    model, _ = build(path)
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert model.lm_head.weight is model.transformer.wte.weight
    assert len(model.attention_layers) == 2
    run_scenario(path, block_size)


@pytest.mark.parametrize("overrides", [
    {"activation_function": "relu"},
    {"activation_function": "gelu", "scale_attn_by_inverse_layer_idx": True},
    {"scale_attn_weights": False, "n_inner": 96, "layer_norm_epsilon": 1e-3},
    {"tie_word_embeddings": False},
], ids=["relu", "gelu-inverse-layer-idx", "unscaled-n_inner-eps", "untied"])
def test_gpt2_variants(checkpoints, overrides):
    path = checkpoints("gpt2", **overrides)
    model, _ = build(path)
    if overrides.get("tie_word_embeddings") is False:
        assert model.lm_head.weight is not model.transformer.wte.weight
    run_scenario(path, 4)


def test_gpt2_checkpoint_without_transformer_prefix(checkpoints, tmp_path):
    """The Hub's gpt2 / DialoGPT files: `h.0.attn.c_attn.weight`, with the causal-mask
    buffers `attn.bias` / `attn.masked_bias` beside the weights."""
    src = checkpoints("gpt2")
    buffers = {}
    for i in range(2):
        buffers[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 512, 512))
        buffers[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    path = rewrite_names(src, tmp_path / "no-prefix", lambda n: n.removeprefix("transformer."),
                         buffers)
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert not any(name.startswith("transformer.") for name in f.keys())  # noqa: SIM118
    run_scenario(path, 16)


def test_gpt2_reorder_and_upcast_attn_is_the_same_math(checkpoints):
    """transformers' eager path with reorder_and_upcast_attn (scores in float32, scale folded
    into the product) gives our logits."""
    path = checkpoints("gpt2", reorder_and_upcast_attn=True)
    from transformers import AutoModelForCausalLM

    prompt = random_tokens(17, 6)
    with torch.inference_mode():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
        expected = hf(torch.tensor([prompt])).logits[0]
    model, config = build(path)
    got = PagedRunner(model, config).step([("p", prompt)])["p"]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_gpt2_cross_attention_config_is_refused(checkpoints, tmp_path):
    path = rewrite_names(checkpoints("gpt2"), tmp_path / "cross", lambda n: n)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["add_cross_attention"] = True
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="add_cross_attention=True"):
        build(path)


def test_gpt2_unexpected_tensor_is_named(checkpoints, tmp_path):
    path = rewrite_names(checkpoints("gpt2"), tmp_path / "extra", lambda n: n,
                         {"transformer.h.0.attn.q_attn.weight": torch.zeros(64, 64)})
    with pytest.raises(ValueError, match="unexpected tensor 'transformer.h.0.attn.q_attn"):
        build(path)


# ---------------------------------------------------------------- OPT

@pytest.mark.parametrize("block_size", [16, 4])
def test_opt_pre_layer_norm(checkpoints, block_size):
    path = checkpoints("opt")
    model, _ = build(path)
    decoder = model.model.decoder
    assert decoder.final_layer_norm is not None and decoder.project_in is None
    assert model.lm_head.weight is decoder.embed_tokens.weight
    run_scenario(path, block_size)


def test_opt_project_in_out_post_layer_norm(checkpoints):
    """opt-350m's layout: embeddings of 32 projected to hidden 64 and back, post-LN blocks,
    no decoder-level final LayerNorm."""
    path = checkpoints("opt", word_embed_proj_dim=32, do_layer_norm_before=False)
    model, _ = build(path)
    decoder = model.model.decoder
    assert decoder.final_layer_norm is None
    assert decoder.project_in.weight.shape == (64, 32)
    assert decoder.project_out.weight.shape == (32, 64)
    run_scenario(path, 4)


@pytest.mark.parametrize("overrides", [
    {"enable_bias": False, "layer_norm_elementwise_affine": False},
    {"activation_function": "gelu", "tie_word_embeddings": False},
    {"_remove_final_layer_norm": True},
], ids=["no-bias-no-affine", "gelu-untied", "removed-final-ln"])
def test_opt_variants(checkpoints, overrides):
    path = checkpoints("opt", **overrides)
    model, _ = build(path)
    if "enable_bias" in overrides:
        assert model.model.decoder.layers[0].fc1.bias is None
    run_scenario(path, 4)


def test_opt_checkpoint_with_decoder_prefix(checkpoints, tmp_path):
    """facebook/opt-* files on the Hub name tensors `decoder.layers.0...` (no `model.`)."""
    src = checkpoints("opt", word_embed_proj_dim=32)
    path = rewrite_names(src, tmp_path / "decoder-prefix", lambda n: n.removeprefix("model."))
    run_scenario(path, 16)


def test_opt_missing_and_unknown_tensors_are_named(checkpoints, tmp_path):
    src = checkpoints("opt")
    path = rewrite_names(src, tmp_path / "missing",
                         lambda n: None if "layers.1.self_attn.k_proj.weight" in n else n)
    with pytest.raises(ValueError, match="missing tensors for: "
                       r"model\.decoder\.layers\.1\.self_attn\.k_proj\.weight$"):
        build(path)
    path = rewrite_names(src, tmp_path / "unknown",
                         lambda n: n.replace("layers.1.fc1", "layers.1.fc3"))
    with pytest.raises(ValueError, match="unexpected tensor 'model.decoder.layers.1.fc3"):
        build(path)


# ---------------------------------------------------------------- TP=2 and tracing

def _tp_config(path: str, tp: int = 1) -> VllmConfig:
    return VllmConfig(model_config=ModelConfig(model=path, dtype="float32"),
                      parallel_config=ParallelConfig(tensor_parallel_size=tp),
                      optimization_level=0)


def _tp_worker(rank, world, port, paths, out_dir):
    from vllm.distributed import (
        destroy_distributed_environment,
        init_distributed_environment,
        initialize_model_parallel,
    )

    torch.set_num_threads(1)
    init_distributed_environment(world, rank, "gloo", f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(world)
    try:
        for name, path in paths.items():
            config = _tp_config(path, tp=world)
            model = get_model(config)
            logits = run_steps(model, config)
            if rank == 0:
                heads = next(iter(model.attention_layers.values())).num_heads
                torch.save((heads, logits), os.path.join(out_dir, f"{name}.pt"))
    finally:
        destroy_distributed_environment()


@pytest.mark.slow
def test_tensor_parallel_2_matches_tp_1(checkpoints, tmp_path, cpu_platform):
    """GPT-2 (fused Conv1D q|k|v split by heads, transposed on load) and OPT with
    project_in/out and post-LN, each over 2 gloo ranks."""
    paths = {"gpt2": checkpoints("gpt2"),
             "opt": checkpoints("opt", word_embed_proj_dim=32, do_layer_norm_before=False)}
    mp.start_processes(_tp_worker, args=(2, free_port(), paths, str(tmp_path)), nprocs=2,
                       start_method="spawn")
    for name, path in paths.items():
        config = _tp_config(path)
        expected = run_steps(get_model(config), config)
        heads, got = torch.load(tmp_path / f"{name}.pt")
        assert heads == 2, f"{name}: 4 heads over 2 ranks"
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0, msg=name)


@pytest.mark.parametrize("family, overrides", [
    ("gpt2", {}), ("opt", {"word_embed_proj_dim": 32, "do_layer_norm_before": False})])
def test_forward_traces_as_one_graph(checkpoints, family, overrides):
    config = _tp_config(checkpoints(family, **overrides))
    model = get_model(config)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model.forward, backend=backend, fullgraph=True, dynamic=True)
    expected = run_steps(model, config)
    model.forward = compiled
    try:
        got = run_steps(model, config)
    finally:
        del model.forward
        torch._dynamo.reset()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert len(graphs) == 1, "a shape or value change caused a recompile"
    op = torch.ops.vllm.unified_attention_with_output
    attention_calls = [node for node in graphs[0].graph.nodes
                       if node.target in (op, op.default)]
    assert len(attention_calls) == config.model_config.get_num_layers() == 2


# ---------------------------------------------------------------- the engine at -O2

@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_llm_o2_greedy_matches_o0(tmp_path, family):
    """Smoke: LLM at -O2 (VLLM_COMPILE through the model's @support_torch_compile stack)
    generates the -O0 greedy tokens."""
    from vllm import LLM, SamplingParams

    path = MAKERS[family](tmp_path / family)  # with a tokenizer
    engine = {"max_model_len": 128, "block_size": 4, "kv_cache_memory": "16MiB",
              "dtype": "float32"}
    prompts = [{"prompt_token_ids": random_tokens(n, n)} for n in (5, 23)]
    params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)
    tokens = {}
    for level in (0, 2):
        kwargs = {"compilation_config": {"cache_dir": str(tmp_path / "cc")}} if level else {}
        llm = LLM(model=path, optimization_level=level, **engine, **kwargs)
        try:
            if level:
                assert llm.llm_engine.vllm_config.compilation_config.mode == 3
            outs = llm.generate(prompts, params, use_tqdm=False)
            tokens[level] = [list(o.outputs[0].token_ids) for o in outs]
        finally:
            llm.llm_engine.shutdown()
    assert tokens[2] == tokens[0]
    assert all(len(t) == 8 for t in tokens[0])
    reference = hf_logits(path, {"p": prompts[0]["prompt_token_ids"]})["p"]
    assert tokens[0][0][0] == int(reference[-1].argmax())
