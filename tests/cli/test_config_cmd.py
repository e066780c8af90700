"""`vllm config`: the resolved table with its provenance column, and one-line errors."""
from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm.entrypoints.cli import main as cli_main
from vllm.platforms import reset_current_platform
from vllm.version import __version__

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_config(capsys, *argv: str) -> str:
    assert cli_main.main(["config", *argv]) == 0
    return capsys.readouterr().out


def row(table: str, field: str) -> str:
    """The table line of `field` (exact field name, first column)."""
    for line in table.splitlines():
        if line.split(" ", 1)[0] == field:
            return line
    raise AssertionError(f"no row {field!r} in\n{table}")


def assert_row(table: str, field: str, value: str, source: str) -> None:
    line = row(table, field)
    assert re.match(rf"{re.escape(field)}\s+{re.escape(value)}\s+{re.escape(source)}(\s|$)",
                    line), line


def cli_error(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        cli_main.main(list(argv))
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


def test_four_levels_four_tables(capsys, tiny):
    tables = {level: run_config(capsys, "--model", tiny, f"-O{level}") for level in range(4)}
    assert len(set(tables.values())) == 4
    for level, out in tables.items():
        summary, header, *_ = out.splitlines()
        assert summary.startswith(f"Optimization level O{level}: ")
        assert header.split() == ["field", "value", "source", "reason"]
        assert_row(out, "optimization_level", f"O{level}", "user")
    assert_row(tables[0], "compilation_config.mode", "NONE", "level O0")
    assert_row(tables[0], "compilation_config.pass_config.eliminate_noops", "False", "level O0")
    for level in (1, 2, 3):
        assert_row(tables[level], "compilation_config.mode", "VLLM_COMPILE", f"level O{level}")
        assert_row(tables[level], "compilation_config.pass_config.eliminate_noops", "True",
                   f"level O{level}")
    assert_row(tables[2], "compilation_config.cudagraph_mode", "NONE", "platform cpu")
    assert_row(tables[2], "compilation_config.freezing", "False", "level O2")
    assert_row(tables[2], "compilation_config.prepack_linear_weights", "True", "platform cpu")
    assert_row(tables[1], "compilation_config.prepack_linear_weights", "False", "level O1")
    assert_row(tables[3], "compilation_config.max_autotune", "False", "platform cpu")
    assert_row(tables[1], "compilation_config.max_autotune", "False", "level O1")


def test_default_level(capsys, tiny):
    out = run_config(capsys, "--model", tiny)
    assert out.startswith("Optimization level O2: ")
    assert_row(out, "optimization_level", "O2", "default")


def test_cuda_platform_gets_full_and_piecewise(capsys, tiny, monkeypatch):
    monkeypatch.setenv("VLLM_PLATFORM", "cuda")
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "TRITON_ATTN")  # decode in full graphs
    reset_current_platform()
    try:
        out = run_config(capsys, "--model", tiny, "-O2")
        assert_row(out, "compilation_config.cudagraph_mode", "FULL_AND_PIECEWISE", "level O2")
        assert "platform cuda" in out.splitlines()[0]
        out = run_config(capsys, "--model", tiny, "-O1")
        assert_row(out, "compilation_config.cudagraph_mode", "PIECEWISE", "level O1")
    finally:
        reset_current_platform()


def test_cuda_table_shows_the_mode_the_attention_backend_runs(capsys, tiny, monkeypatch):
    """TORCH_SDPA runs no batch inside a full CUDA graph: the table shows the piecewise mode
    that will run, and why (the model runner no longer narrows it after resolution)."""
    monkeypatch.setenv("VLLM_PLATFORM", "cuda")
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "TORCH_SDPA")
    reset_current_platform()
    try:
        out = run_config(capsys, "--model", tiny, "-O2")
    finally:
        reset_current_platform()
    assert_row(out, "compilation_config.cudagraph_mode", "PIECEWISE",
               "derived: downgrade from FULL_AND_PIECEWISE")
    assert "TORCH_SDPA attention backend cannot run inside a full CUDA graph" in row(
        out, "compilation_config.cudagraph_mode")
    assert "CUDA graphs PIECEWISE" in out.splitlines()[0]


def test_explicit_cli_values_show_user(capsys, tiny):
    out = run_config(capsys, "--model", tiny, "-O0", "-cc.mode=vllm_compile",
                     "-cc.pass_config.eliminate_noops=true", "--max-num-seqs", "8",
                     "--dtype", "float32")
    assert_row(out, "compilation_config.mode", "VLLM_COMPILE", "user")
    assert_row(out, "compilation_config.pass_config.eliminate_noops", "True", "user")
    assert_row(out, "compilation_config.pass_config.fuse_norm_quant", "False", "level O0")
    assert_row(out, "scheduler_config.max_num_seqs", "8", "user")
    assert_row(out, "model_config.dtype", "float32", "user")


def test_json_output(capsys, tiny):
    assert cli_main.main(["config", "--model", tiny, "-O1", "--json", "-cc.backend=eager"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["optimization_level"] == {"value": "O1", "source": "user", "reason": ""}
    assert data["compilation_config.mode"]["value"] == "VLLM_COMPILE"
    assert data["compilation_config.mode"]["source"] == "level O1"
    assert data["compilation_config.backend"]["source"] == "user"
    assert "Optimization level O1" in captured.err


@pytest.mark.parametrize("argv, expected", [
    (["--enforce-eager", "-O2"], "enforce_eager"),
    (["-cc.cudagraph_mode=full"], "cudagraph_mode=FULL cannot be honoured"),
    (["--cudagraph-capture-sizes", "1", "-cc.cudagraph_capture_sizes=[2]"],
     "are mutually exclusive"),
    (["-O3", "-O5"], "Invalid optimization level '5'"),
    (["-cc", "{"], "line 1 column 2 (char 1)"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
])
def test_errors_are_one_line(capsys, tiny, argv, expected):
    line = cli_error(capsys, "config", "--model", tiny, *argv)
    assert line.startswith("vllm config: error: ")
    assert expected in line


def test_bad_model_folder(capsys, tmp_path):
    line = cli_error(capsys, "config", "--model", str(tmp_path / "missing"))
    assert "is not a local folder" in line


def test_no_subcommand_and_unknown_subcommand(capsys):
    assert "the following arguments are required" in cli_error(capsys)
    assert "invalid choice: 'nope'" in cli_error(capsys, "nope")


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main.main(["--version"])
    assert exc.value.code == 0
    assert __version__ in capsys.readouterr().out


def test_subcommand_modules_expose_the_contract():
    for name in cli_main.SUBCOMMANDS:
        module = importlib.import_module(name)
        assert callable(module.add_parser) and callable(module.run)


def test_subprocess_bad_level_exits_2_with_one_line(tiny):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("VLLM_PLATFORM", None)
    result = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", "config", "--model", tiny, "-O5"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("vllm config: error: argument --optimization-level: ")
    assert "Invalid optimization level '5'" in lines[0] and "0, 1, 2 or 3" in lines[0]
    assert result.stdout == ""
