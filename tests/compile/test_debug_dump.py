"""debug_dump_path: the files, the index, and what a failure leaves behind."""
from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from vllm.compilation.debug_dump import CompilationStageError
from vllm.compilation.decorators import support_torch_compile
from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config

SILLY_OP = "silly_dump::attention"


@torch.library.custom_op(SILLY_OP, mutates_args=["out"])
def silly_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(q - k + v)


@support_torch_compile
class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        out = torch.empty_like(x)
        torch.ops.silly_dump.attention(x, x, x, out)
        return self.b(out.reshape(-1, 4)) + positions[:, None]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def build(dump: str | None, backend: str = "eager") -> Toy:
    config = VllmConfig(optimization_level=1, compilation_config=CompilationConfig(
        backend=backend, splitting_ops=[SILLY_OP], debug_dump_path=dump))
    with set_current_vllm_config(config):
        return Toy()


def run(model: Toy, n: int = 3) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.randn(n, 4), torch.arange(n, dtype=torch.float32))


def test_dump_writes_graphs_pieces_passes_config_and_index(tmp_path, cpu_platform):
    run(build(str(tmp_path)))
    rank = tmp_path / "rank_0"
    for name in ("graph.dynamo.py", "split_module.py", "piece_0.py", "piece_1.py", "piece_2.py",
                 "config.json", "index.md"):
        assert (rank / name).is_file(), name
    assert "silly_dump.attention" in (rank / "piece_1.py").read_text()
    passes = sorted(os.listdir(rank / "piece_2" / "range_1_2048"))
    assert "post_grad.0.NoOpEliminationPass.before.py" in passes
    assert "post_grad.0.NoOpEliminationPass.after.py" in passes
    assert passes[-1] == "post_grad.2.FixFunctionalizationPass.before.py"
    before = (rank / "piece_2/range_1_2048/post_grad.0.NoOpEliminationPass.before.py").read_text()
    after = (rank / "piece_2/range_1_2048/post_grad.0.NoOpEliminationPass.after.py").read_text()
    assert "aten.view" in before and "aten.view" not in after  # the no-op reshape went away
    config = json.loads((rank / "config.json").read_text())
    assert config["compilation_config.mode"] == {"value": "VLLM_COMPILE", "source": "level O1",
                                                 "reason": ""}
    index = (rank / "index.md").read_text()
    for name in ("graph.dynamo.py", "piece_1.py", "config.json", "piece_2/range_1_2048/"):
        assert f"`{name}`" in index
    entries = [line for line in index.splitlines() if line.startswith("- `")]
    assert all(": " in line for line in entries)  # one line each, with a description


def test_no_dump_path_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run(build(None))
    assert os.listdir(tmp_path) == []


def test_failure_with_dump_points_at_it(tmp_path, monkeypatch):
    from vllm.compilation.compiler_interface import EagerCompiler

    def broken(self, gm, example_inputs, compile_range, piece_index, dump_dir):
        raise RuntimeError("no kernel for you")

    monkeypatch.setattr(EagerCompiler, "compile", broken)
    with pytest.raises(CompilationStageError) as info:
        run(build(str(tmp_path)))
    message = str(info.value)
    assert "eager compile of piece 0" in message
    assert str(tmp_path / "rank_0") in message and "-cc.debug_dump_path" not in message
    assert (tmp_path / "rank_0" / "graph.dynamo.py").is_file()  # what it had is written
    index = (tmp_path / "rank_0" / "index.md").read_text()
    assert "`piece_0.py`" in index
    # The index opens with the failure; failure.txt holds the message and the traceback.
    assert "compilation FAILED during eager compile of piece 0" in index.split("- `")[0]
    failure = (tmp_path / "rank_0" / "failure.txt").read_text()
    assert "no kernel for you" in failure and "Traceback" in failure


def test_ctrl_c_during_a_compile_is_not_a_compile_failure(tmp_path, monkeypatch):
    """Ctrl-C while a piece compiles reaches the caller as KeyboardInterrupt (it was turned
    into "Compilation failed during inductor compile of piece N", exit status 1)."""
    from vllm.compilation.compiler_interface import EagerCompiler

    def interrupted(self, gm, example_inputs, compile_range, piece_index, dump_dir):
        raise KeyboardInterrupt

    monkeypatch.setattr(EagerCompiler, "compile", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(build(str(tmp_path)))
    assert not (tmp_path / "rank_0" / "failure.txt").exists()


@pytest.mark.slow
def test_inductor_dump_records_output_code(tmp_path):
    run(build(str(tmp_path), backend="inductor"))
    listing = (tmp_path / "rank_0" / "inductor_output_code.txt").read_text().splitlines()
    assert len(listing) == 2
    for line in listing:
        path = line.split(": ", 1)[1]
        assert path.endswith("output_code.py") and os.path.isfile(path)


def test_env_path_wins_with_a_warning_and_o0_says_it_dumps_nothing(tmp_path, monkeypatch,
                                                                    caplog):
    monkeypatch.setenv("VLLM_DEBUG_DUMP_PATH", str(tmp_path / "env"))
    config = VllmConfig(optimization_level=1,
                        compilation_config={"debug_dump_path": str(tmp_path / "cli")})
    assert config.compilation_config.debug_dump_path == str(tmp_path / "env")
    assert "overridden by VLLM_DEBUG_DUMP_PATH" in caplog.text
    monkeypatch.delenv("VLLM_DEBUG_DUMP_PATH")
    caplog.clear()
    VllmConfig(optimization_level=0, compilation_config={"debug_dump_path": str(tmp_path)})
    assert "compiles nothing, so nothing is dumped" in caplog.text


def test_a_dump_path_that_cannot_be_a_directory_is_refused_while_resolving(tmp_path,
                                                                          monkeypatch):
    """Named with the value and the reason, before anything compiles (it used to surface as
    a failed Dynamo trace)."""
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for path, reason in [(a_file, "it is a file, not a directory"),
                         (a_file / "below", "it cannot be created: .* is a file")]:
        with pytest.raises(ValueError, match=f"debug_dump_path '{path}'.*{reason}"):
            VllmConfig(optimization_level=1, compilation_config={"debug_dump_path": str(path)})
    monkeypatch.setenv("VLLM_DEBUG_DUMP_PATH", str(a_file))
    with pytest.raises(ValueError, match="VLLM_DEBUG_DUMP_PATH .* is a file, not a directory"):
        VllmConfig(optimization_level=1)
    monkeypatch.delenv("VLLM_DEBUG_DUMP_PATH")
    # A directory still to be made (nested) is fine: the dump creates it.
    nested = tmp_path / "new" / "dump"
    config = VllmConfig(optimization_level=1, compilation_config={"debug_dump_path": str(nested)})
    assert config.compilation_config.debug_dump_path == str(nested)
