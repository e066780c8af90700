"""The decorator and VllmBackend on a toy model with a "silly attention" split point."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from vllm.compilation.counter import compilation_counter
from vllm.compilation.debug_dump import CompilationStageError
from vllm.compilation.decorators import RecompileError, support_torch_compile
from vllm.compilation.passes.inductor_pass import VllmInductorPass
from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
from vllm.config.compilation import CompilationMode

SILLY_OP = "silly_backend::attention"


@torch.library.custom_op(SILLY_OP, mutates_args=["out"])
def silly_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(q * 2 + k - v)


@support_torch_compile
class ToyModel(nn.Module):
    """embed -> (silly attention -> linear) x num_attn; forward(input_ids, positions)."""

    def __init__(self, num_attn: int = 2, hidden: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, hidden)
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(num_attn))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + positions.unsqueeze(-1).to(torch.float32)
        for layer in self.layers:
            out = torch.empty_like(x)
            torch.ops.silly_backend.attention(x, x, x, out)
            x = layer(out.reshape(-1, x.shape[-1])).relu()
        return x


def make_config(level: int = 1, **compilation) -> VllmConfig:
    compilation.setdefault("backend", "eager")
    compilation.setdefault("splitting_ops", [SILLY_OP])
    return VllmConfig(optimization_level=level,
                      compilation_config=CompilationConfig(**compilation))


def build(config: VllmConfig, **kwargs) -> ToyModel:
    torch.manual_seed(0)
    with set_current_vllm_config(config):
        return ToyModel(**kwargs)


def inputs(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 32, (n,)), torch.arange(n)


def eager_reference(model: ToyModel, ids, pos):
    return model._vllm_compile_state.original_forward(model, ids, pos)


@pytest.fixture(autouse=True)
def _fresh_dynamo(monkeypatch):
    monkeypatch.setenv("VLLM_TEST_FAIL_ON_RECOMPILE", "1")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("num_attn", [1, 2])
def test_piecewise_counts_and_outputs_match_eager(num_attn):
    model = build(make_config(), num_attn=num_attn)
    with torch.no_grad(), compilation_counter.expect(
            num_graphs_seen=1,
            num_piecewise_graphs_seen=2 * num_attn + 1,
            num_piecewise_capturable_graphs_seen=num_attn + 1,
            num_backend_compilations=num_attn + 1,
            num_recompiles=0):
        for n in (8, 1, 3, 17, 2):
            ids, pos = inputs(n)
            torch.testing.assert_close(model(ids, pos), eager_reference(model, ids, pos))


@support_torch_compile
class RotaryLike(nn.Module):
    """The rotary-embedding pattern: viewing a non-contiguous split of the input with the
    token count and -1 makes Dynamo assume num_tokens >= 2 when the first call has more
    tokens. The decorator drops that shape guard, so 1-token batches do not recompile."""

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, k = x.split([4, 4], dim=-1)
        rotated = q.view(positions.shape[0], -1, 2) * 1.5
        return rotated.reshape(q.shape) + k


def test_one_token_batch_after_a_larger_first_trace_does_not_recompile():
    with set_current_vllm_config(make_config(splitting_ops=[])):
        model = RotaryLike()
    with torch.no_grad(), compilation_counter.expect(num_graphs_seen=1, num_recompiles=0):
        for n in (9, 1, 2):
            x = torch.randn(n, 8)
            torch.testing.assert_close(model(x, torch.arange(n)),
                                       model._vllm_compile_state.original_forward(
                                           model, x, torch.arange(n)))


def test_mode_none_does_nothing():
    config = make_config(level=0)
    assert config.compilation_config.mode == CompilationMode.NONE
    with compilation_counter.expect(num_models_seen=0, num_graphs_seen=0,
                                    num_backend_compilations=0):
        model = build(config)
        ids, pos = inputs(4)
        with torch.no_grad():
            model(ids, pos)
    assert model.__dict__.get("_vllm_compile_state") is None


def test_built_without_config_is_not_compiled():
    with compilation_counter.expect(num_graphs_seen=0):
        model = ToyModel()
        with torch.no_grad():
            model(*inputs(3))


def test_passes_run_on_the_pieces():
    config = make_config(level=1)
    assert config.compilation_config.pass_config.eliminate_noops
    model = build(config)
    with torch.no_grad():
        model(*inputs(5))
    backend = model._vllm_compile_state.vllm_backend
    names = [p.name for p in backend.pass_manager.all_passes()]
    assert names == ["NoOpEliminationPass", "PostCleanupPass", "FixFunctionalizationPass"]
    # out.reshape(-1, hidden) is a no-op reshape in every layer piece.
    assert backend.pass_manager.match_counts()["NoOpEliminationPass"] >= 1


@pytest.mark.parametrize("mode", [CompilationMode.STOCK_TORCH_COMPILE,
                                  CompilationMode.DYNAMO_TRACE_ONCE])
def test_torch_backends_trace_once(mode):
    model = build(make_config(mode=mode, splitting_ops=[]))
    with torch.no_grad(), compilation_counter.expect(num_graphs_seen=1,
                                                     stock_torch_compile_count=1,
                                                     num_piecewise_graphs_seen=0):
        for n in (6, 1, 4):
            ids, pos = inputs(n)
            torch.testing.assert_close(model(ids, pos), eager_reference(model, ids, pos))


def test_stock_inductor_compile_is_its_own_startup_row():
    """STOCK_TORCH_COMPILE with Inductor: the compile is an "inductor compilation" event, not
    part of the "dynamo tracing" row (it was booked there, with 0 compiles shown)."""
    from vllm.utils.startup_timer import reset_startup_timer

    model = build(make_config(mode=CompilationMode.STOCK_TORCH_COMPILE, backend="inductor",
                              splitting_ops=[]))
    timer = reset_startup_timer()
    with torch.no_grad():
        model(*inputs(5))
    events = timer.as_dict()["phases"]["inductor compilation"]["events"]
    assert [e["piece"] for e in events] == ["whole graph"]
    assert timer.seconds("inductor compilation") > timer.seconds("dynamo tracing") > 0


def _recompile_trigger(model):
    # A float64 positions tensor fails a dtype guard of the first trace.
    ids = torch.randint(0, 32, (4,))
    return model(ids, torch.arange(4, dtype=torch.float64))


def test_recompile_is_counted_and_raises_in_tests():
    model = build(make_config())
    with torch.no_grad():
        model(*inputs(4))
        with compilation_counter.expect(num_recompiles=1), \
                pytest.raises(RecompileError, match="VLLM_TEST_FAIL_ON_RECOMPILE"):
            _recompile_trigger(model)


def test_recompile_warns_outside_tests(monkeypatch, caplog):
    monkeypatch.setenv("VLLM_TEST_FAIL_ON_RECOMPILE", "0")
    model = build(make_config())
    with torch.no_grad():
        model(*inputs(4))
        with compilation_counter.expect(num_recompiles=1, num_graphs_seen=1):
            _recompile_trigger(model)
    assert "traced again by Dynamo" in caplog.text


def test_dynamo_trace_once_keeps_no_guards():
    model = build(make_config(mode=CompilationMode.DYNAMO_TRACE_ONCE, splitting_ops=[]))
    with torch.no_grad():
        model(*inputs(4))
        # Not even a dtype change re-traces: the compiled code is called as it is.
        with compilation_counter.expect(num_graphs_seen=0, num_recompiles=0):
            _recompile_trigger(model)
            model(*inputs(1))


@support_torch_compile
class Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if positions.sum().item() > 0:  # data-dependent branch: no full graph
            return self.linear(input_ids)
        return input_ids


def test_dynamo_failure_names_the_stage_and_suggests_O0():
    with set_current_vllm_config(make_config()):
        model = Untraceable()
    with pytest.raises(CompilationStageError) as info, torch.no_grad():
        model(torch.randn(3, 4), torch.arange(3))
    message = str(info.value)
    assert "during dynamo trace" in message
    assert "-O0" in message and "-cc.debug_dump_path=DIR" in message
    assert info.value.__cause__ is not None  # the original exception is chained


def test_unknown_inductor_option_is_refused_before_the_trace():
    """Inductor would fail only inside the first piece's compile (an AttributeError wrapped as
    a compile failure suggesting -O0); the key is a config mistake: a ValueError naming it and
    the closest options, before Dynamo runs."""
    model = build(make_config(backend="inductor",
                              inductor_compile_config={"max_autotun": True}))
    with compilation_counter.expect(num_graphs_seen=0), torch.no_grad():  # no trace ran
        with pytest.raises(ValueError, match=r"'max_autotun' is not an Inductor option; did "
                                             r"you mean 'max_autotune'"):
            model(*inputs(3))
    from vllm.compilation.compiler_interface import check_inductor_options

    check_inductor_options({"max_autotune": False, "cpp.threads": 2})  # real ones pass


class BoomPass(VllmInductorPass):
    def apply(self, graph):
        raise KeyError("no such node")


def test_pass_failure_names_the_pass(monkeypatch):
    from vllm.compilation.passes import registry

    # Adding a pass is one registry entry: (PassConfig flag, order, "module:Class").
    monkeypatch.setattr(registry, "PASS_REGISTRY", [
        *registry.PASS_REGISTRY, registry.PassEntry("eliminate_noops", 15, f"{__name__}:BoomPass")])
    model = build(make_config())
    with pytest.raises(CompilationStageError) as info, torch.no_grad():
        model(*inputs(3))
    assert "during pass BoomPass" in str(info.value)
    assert "piece 0" in str(info.value)
    assert isinstance(info.value.__cause__, KeyError)


def test_compile_failure_names_the_piece(monkeypatch):
    from vllm.compilation.compiler_interface import EagerCompiler

    def broken(self, gm, example_inputs, compile_range, piece_index, dump_dir):
        if piece_index == 2:
            raise RuntimeError("codegen exploded")
        return gm

    monkeypatch.setattr(EagerCompiler, "compile", broken)
    model = build(make_config())
    with pytest.raises(CompilationStageError) as info, torch.no_grad():
        model(*inputs(3))
    assert "eager compile of piece 2" in str(info.value)
    assert "codegen exploded" in str(info.value)


@pytest.mark.slow
def test_inductor_backend_tiny_model(monkeypatch):
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")
    model = build(make_config(level=1, backend="inductor"), num_attn=1)
    with torch.no_grad(), compilation_counter.expect(num_backend_compilations=2,
                                                     num_recompiles=0):
        for n in (5, 1, 9):
            ids, pos = inputs(n)
            torch.testing.assert_close(model(ids, pos), eager_reference(model, ids, pos))


@pytest.mark.slow
def test_inductor_freezing_folds_weights_and_skips_the_cache(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    config = make_config(level=2, backend="inductor", freezing=True)
    model = build(config, num_attn=1)
    with torch.no_grad(), compilation_counter.expect(num_backend_compilations=2,
                                                     num_cache_saves=0, num_recompiles=0):
        for n in (4, 1, 7):
            ids, pos = inputs(n)
            torch.testing.assert_close(model(ids, pos), eager_reference(model, ids, pos))
    # Nothing saved; Inductor's C++ objects are kept under the key's directory.
    assert "compile cache: miss (Inductor freezing" in caplog.text
    assert os.path.isdir(model._vllm_compile_state.vllm_backend.cache.inductor_cache_dir)
    backend = model._vllm_compile_state.vllm_backend
    piece = backend.split_gm.__dict__["submod_2"]
    # The linear's weight and bias became attributes Inductor folds; the call drops them.
    assert len([n for n in piece.gm.graph.nodes if n.op == "get_attr"]) == 2
    assert piece.keep is not None


def test_many_model_instances_in_one_process_each_trace_once():
    # Dynamo limits compiled entries per code object (8): every instance gets its own copy
    # of forward's code, so a process may build many models (tests, benchmarks).
    with torch.no_grad(), compilation_counter.expect(num_graphs_seen=10, num_recompiles=0):
        for _ in range(10):
            model = build(make_config())
            ids, pos = inputs(3)
            torch.testing.assert_close(model(ids, pos), eager_reference(model, ids, pos))
