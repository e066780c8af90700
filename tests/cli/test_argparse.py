"""FlexibleArgumentParser: vLLM's command-line spellings (-O<n>, -cc JSON, dotted -cc keys)."""
from __future__ import annotations

import json
import logging

import pytest

from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode, OptimizationLevel
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser


def make_parser() -> FlexibleArgumentParser:
    return EngineArgs.add_cli_args(FlexibleArgumentParser(prog="vllm test"))


def parse(*argv: str):
    return make_parser().parse_args(list(argv))


def parse_error(capsys, *argv: str) -> str:
    """Parse `argv`, expect exit code 2 and one error line without a traceback; return it."""
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("vllm test: error: ")
    return lines[0]


def _cc(data: dict) -> CompilationConfig:
    """What -cc parses to: a CompilationConfig holding just the keys given."""
    return CompilationConfig.from_dict(data)


def duplicate_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "Found duplicate keys" in r.getMessage()]


# ---- optimization level --------------------------------------------------------------------
@pytest.mark.parametrize("argv, level", [
    (["-O0"], 0), (["-O1"], 1), (["-O3"], 3),
    (["-O=2"], 2), (["-O=0"], 0),
    (["-O", "2"], 2), (["-O", "0"], 0),
    (["--optimization-level", "1"], 1), (["--optimization-level=3"], 3),
    (["--optimization_level=1"], 1), (["--optimization_level", "0"], 0),
    (["--optimization-level", "O2"], 2), (["-OO1"], 1),
])
def test_level_spellings(argv, level):
    """The level is checked at parse time and kept as given (upstream's parse result)."""
    args = parse(*argv)
    assert isinstance(args.optimization_level, str)
    assert OptimizationLevel.parse(args.optimization_level) == level


def test_level_default_is_unset():
    assert parse().optimization_level is None


@pytest.mark.parametrize("argv", [["-O1", "-O3"], ["-O1", "--optimization_level", "3"],
                                  ["--optimization-level=0", "-O", "3"]])
def test_duplicate_level_last_wins_with_warning(caplog, argv):
    with caplog.at_level(logging.WARNING, logger="vllm"):
        args = parse(*argv)
    assert OptimizationLevel.parse(args.optimization_level) == OptimizationLevel.O3
    warnings = duplicate_warnings(caplog)
    assert len(warnings) == 1 and "--optimization-level" in warnings[0]


def test_no_duplicate_warning_for_single_level(caplog):
    with caplog.at_level(logging.WARNING, logger="vllm"):
        parse("-O1", "-cc.mode=3")
    assert duplicate_warnings(caplog) == []


@pytest.mark.parametrize("value", ["4", "banana", "-1", '{"mode":3}'])
def test_separate_O_with_a_bad_level_names_it(capsys, value):
    line = parse_error(capsys, "-O", value)
    assert f"Invalid optimization level '{value}'" in line and "0, 1, 2 or 3" in line
    # The old meaning of -O (a compilation config) gets pointed at -cc.
    assert ("-cc" in line) == value.startswith("{")


@pytest.mark.parametrize("argv", [("-O", "--seed", "1"), ("--seed", "1", "-O")])
def test_separate_O_without_a_level_says_what_it_needs(capsys, argv):
    """A bare -O (last, or before another flag) is refused, naming the levels (upstream:
    an argparse error)."""
    assert "-O needs a level: 0, 1, 2 or 3" in parse_error(capsys, *argv)


@pytest.mark.parametrize("argv, bad", [(["-O5"], "5"), (["-Ofast"], "fast"),
                                       (["--optimization-level", "x"], "x"),
                                       (["-O=7"], "7"), (["-O.mode=3"], ".mode=3")])
def test_bad_level(capsys, argv, bad):
    line = parse_error(capsys, *argv)
    assert f"Invalid optimization level '{bad}'" in line
    assert "0, 1, 2 or 3" in line


def test_preprocess_argv_rewrites_and_keeps_tail():
    parser = make_parser()
    assert parser.preprocess_argv(["-O1", "--max_num_seqs=4", "--", "-O2", "--a_b"]) == [
        "--optimization-level", "1", "--max-num-seqs=4", "--", "-O2", "--a_b"]
    # Only the option name changes, not the dotted key or the value.
    assert parser.preprocess_argv(["--served_model_name=my_model"]) == [
        "--served-model-name=my_model"]
    assert parser.preprocess_argv(["--compilation_config.pass_config.fuse_norm_quant=false"]) == [
        "--compilation-config", '{"pass_config": {"fuse_norm_quant": false}}']


# ---- -cc / --compilation-config ------------------------------------------------------------
def test_cc_json():
    args = parse("-cc", '{"mode": 3, "pass_config": {"fuse_norm_quant": false}}')
    assert args.compilation_config == _cc({"mode": 3, "pass_config": {"fuse_norm_quant": False}})
    args = parse("--compilation-config", '{"backend": "eager"}')
    assert args.compilation_config == _cc({"backend": "eager"})
    args = parse("--compilation_config={\"backend\": \"eager\"}")
    assert args.compilation_config == _cc({"backend": "eager"})


def test_cc_dotted_merge():
    args = parse("-cc.pass_config.fuse_norm_quant=false", "-O1", "-cc.mode", "3",
                 "--compilation-config.backend=eager", "--compilation_config.pass_config."
                 "eliminate_noops", "true", "-cc.cudagraph_mode=piecewise")
    assert args.optimization_level == "1"
    assert args.compilation_config == _cc({
        "pass_config": {"fuse_norm_quant": False, "eliminate_noops": True},
        "mode": 3, "backend": "eager", "cudagraph_mode": "piecewise"})


def test_cc_dotted_appended_at_end_replaces_full_json(caplog):
    with caplog.at_level(logging.WARNING, logger="vllm"):
        args = parse("-cc", '{"mode": 3}', "-cc.backend=eager")
    assert args.compilation_config == _cc({"backend": "eager"})
    assert any("--compilation-config" in w for w in duplicate_warnings(caplog))


def test_cc_dotted_dict_values_merge_recursively():
    args = parse("-cc.pass_config={\"fuse_norm_quant\": true}",
                 "-cc.pass_config.eliminate_noops=false")
    assert args.compilation_config == _cc({
        "pass_config": {"fuse_norm_quant": True, "eliminate_noops": False}})


def test_cc_dotted_repeated_scalar_overwrites_with_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="vllm"):
        args = parse("-cc.mode=1", "-cc.mode=3")
    assert args.compilation_config == _cc({"mode": 3})
    warnings = duplicate_warnings(caplog)
    assert len(warnings) == 1 and "--compilation-config.mode" in warnings[0]


def test_cc_dotted_value_kept_as_string_when_not_json():
    assert parse("-cc.backend=inductor").compilation_config == _cc({"backend": "inductor"})
    assert parse("-cc.debug_dump_path", "/tmp/x").compilation_config == _cc({
        "debug_dump_path": "/tmp/x"})


def test_cc_list_append(caplog):
    args = parse("-cc.custom_ops+=+rms_norm,-quant_fp8")
    assert args.compilation_config == _cc({"custom_ops": ["+rms_norm", "-quant_fp8"]})
    with caplog.at_level(logging.WARNING, logger="vllm"):
        args = parse("-cc.custom_ops+=+rms_norm", "-cc.custom_ops+", "-quant_fp8,+silu_and_mul")
    assert args.compilation_config == _cc(
        {"custom_ops": ["+rms_norm", "-quant_fp8", "+silu_and_mul"]})
    assert duplicate_warnings(caplog) == []
    args = parse("-cc.compile_sizes+=1,2", "-cc.compile_sizes+=[4]")
    assert args.compilation_config == _cc({"compile_sizes": [1, 2, 4]})


@pytest.mark.parametrize("value, mode", [
    ("0", CompilationMode.NONE), ("3", CompilationMode.VLLM_COMPILE),
    ("none", CompilationMode.NONE), ("NONE", CompilationMode.NONE),
    ("vllm_compile", CompilationMode.VLLM_COMPILE), ("Vllm_Compile", CompilationMode.VLLM_COMPILE),
    ("stock_torch_compile", CompilationMode.STOCK_TORCH_COMPILE),
    ("DYNAMO_TRACE_ONCE", CompilationMode.DYNAMO_TRACE_ONCE),
])
def test_cc_mode_ints_and_names(value, mode):
    for argv in (["-cc.mode=" + value], ["-cc.mode", value]):
        assert parse(*argv).compilation_config.mode == mode


@pytest.mark.parametrize("value", ["piecewise", "FULL_AND_PIECEWISE", "Full_Decode_Only"])
def test_cc_cudagraph_mode_names_any_case(value):
    cc = parse(f"-cc.cudagraph_mode={value}").compilation_config
    assert cc.cudagraph_mode == CUDAGraphMode[value.upper()]


# ---- bad -cc input -------------------------------------------------------------------------
def test_cc_invalid_json(capsys):
    line = parse_error(capsys, "-cc", '{"mode": 3,}')
    assert "invalid JSON" in line and "line 1 column 12 (char 11)" in line
    line = parse_error(capsys, "-cc", "mode=3")
    assert "invalid JSON" in line and "line 1 column 1 (char 0)" in line


def test_cc_not_an_object(capsys):
    line = parse_error(capsys, "-cc", "[1, 2]")
    assert "must be a JSON object" in line


@pytest.mark.parametrize("argv, key, hint", [
    (["-cc", '{"modee": 3}'], "modee", "mode"),
    (["-cc.backnd=eager"], "backnd", "backend"),
    (["-cc.pass_config.fuse_norm_qaunt=true"], "fuse_norm_qaunt", "fuse_norm_quant"),
])
def test_cc_unknown_key_names_closest(capsys, argv, key, hint):
    line = parse_error(capsys, *argv)
    assert "Unknown key" in line and key in line and f"did you mean '{hint}'" in line


def test_cc_bad_mode_lists_valid_modes(capsys):
    line = parse_error(capsys, "-cc.mode=fast")
    assert "Invalid compilation mode: 'fast'" in line
    for name in ("NONE", "STOCK_TORCH_COMPILE", "DYNAMO_TRACE_ONCE", "VLLM_COMPILE"):
        assert name in line
    line = parse_error(capsys, "-cc.mode=7")
    assert "Invalid compilation mode: 7" in line


def test_cc_bad_cudagraph_mode_lists_valid_modes(capsys):
    line = parse_error(capsys, "-cc.cudagraph_mode=x")
    assert "Invalid cudagraph_mode: 'x'" in line and "FULL_AND_PIECEWISE" in line


def test_cc_bad_value_type(capsys):
    line = parse_error(capsys, "-cc.pass_config.fuse_norm_quant=maybe")
    assert "fuse_norm_quant must be true or false" in line
    line = parse_error(capsys, "-cc.cpp_wrapper=maybe")
    assert "compilation_config.cpp_wrapper must be true or false, got 'maybe'" in line


def test_cc_dotted_without_value(capsys):
    line = parse_error(capsys, "-cc.mode")
    assert "'-cc.mode' needs a value" in line


def test_cc_dotted_empty_key(capsys):
    line = parse_error(capsys, "-cc..mode=3")
    assert "empty key" in line


def test_dotted_key_on_a_switch(capsys):
    line = parse_error(capsys, "--enforce-eager.x=1")
    assert "--enforce-eager is a switch and takes no dotted keys" in line


def test_dotted_keys_on_any_option_that_takes_a_value():
    """As upstream's parser: dotted keys build a JSON object for any option (here one with
    json.loads as its type); an option that cannot read JSON rejects the value."""
    parser = FlexibleArgumentParser(prog="vllm test")
    parser.add_argument("--overrides", type=json.loads)
    args = parser.parse_args(["--overrides.a.b", "1", "--overrides.c=x.y", "--overrides.d+=1,2"])
    assert args.overrides == {"a": {"b": 1}, "c": "x.y", "d": [1, 2]}


# ---- sizes and the other engine flags ------------------------------------------------------
@pytest.mark.parametrize("argv, flag", [
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--max-model-len", "-1"], "--max-model-len"),
    (["--max-model-len=-1"], "--max-model-len"),
    (["--block-size", "0"], "--block-size"),
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size"),
    (["-tp", "-2"], "--tensor-parallel-size"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    (["--num-gpu-blocks-override", "0"], "--num-gpu-blocks-override"),
    (["--cudagraph-capture-sizes", "1", "0"], "--cudagraph-capture-sizes"),
])
def test_non_positive_sizes(capsys, argv, flag):
    line = parse_error(capsys, *argv)
    assert flag in line and "must be a positive integer" in line
    assert repr(argv[-1].split("=")[-1]) in line


def test_bad_sizes(capsys):
    assert "invalid integer 'lots'" in parse_error(capsys, "--max-num-seqs", "lots")
    assert "must be a positive size" in parse_error(capsys, "--kv-cache-memory", "0")
    assert "must be an integer >= 0" in parse_error(capsys, "--max-cudagraph-capture-size", "-1")


def test_human_readable_sizes():
    args = parse("--max-num-batched-tokens", "4k", "--kv-cache-memory", "4GiB",
                 "--max-model-len", "2k")
    assert args.max_num_batched_tokens == 4000
    assert args.kv_cache_memory == 4 * 1024**3
    assert args.max_model_len == 2000


def test_boolean_flags_and_lists(caplog):
    args = parse()
    assert args.enable_prefix_caching is True and args.enable_chunked_prefill is True
    args = parse("--no-enable-prefix-caching", "--no-enable-chunked-prefill", "--enforce-eager",
                 "--cudagraph-capture-sizes", "1", "2", "4", "-tp", "2",
                 "--distributed-executor-backend", "mp")
    assert args.enable_prefix_caching is False and args.enable_chunked_prefill is False
    assert args.enforce_eager is True
    assert args.cudagraph_capture_sizes == [1, 2, 4]
    assert args.tensor_parallel_size == 2 and args.distributed_executor_backend == "mp"
    with caplog.at_level(logging.WARNING, logger="vllm"):
        args = parse("--enable-prefix-caching", "--no-enable-prefix-caching")
    assert args.enable_prefix_caching is False
    assert any("--enable-prefix-caching" in w for w in duplicate_warnings(caplog))


def test_negative_number_value_is_not_a_dotted_key():
    assert parse("--gpu-memory-utilization", "-0.5").gpu_memory_utilization == -0.5


def test_upstream_utility_import_paths():
    """`from vllm.utils import FlexibleArgumentParser, random_uuid` (upstream's paths)."""
    from vllm.utils import FlexibleArgumentParser, random_uuid
    from vllm.utils.argparse_utils import FlexibleArgumentParser as Parser

    assert FlexibleArgumentParser is Parser
    ids = {random_uuid() for _ in range(3)}
    assert len(ids) == 3 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_config_file_options_with_the_command_line_winning(tmp_path, capsys):
    """upstream's `vllm serve --config FILE.yaml`: keys in either spelling, true = a switch,
    false = not given, lists and mappings; the command line's value wins."""
    from vllm.entrypoints.cli.main import build_parser, main

    cfg = tmp_path / "serve.yaml"
    cfg.write_text("port: 8123\nmax_model_len: 256\nserved-model-name: [a, b]\n"
                   "enable-log-requests: true\ntrust-remote-code: false\n"
                   "compilation-config: {mode: 0}\n")
    args = build_parser().parse_args(["serve", "demo", "--config", str(cfg), "--port", "9000"])
    assert (args.port, args.max_model_len, args.served_model_name) == (9000, 256, ["a", "b"])
    assert args.enable_log_requests and not args.trust_remote_code
    assert args.compilation_config == _cc({"mode": 0}) and args.model_tag == "demo"
    for text, words in [("- a list\n", "must hold a YAML mapping"), ("a: [\n", "cannot read")]:
        cfg.write_text(text)
        with pytest.raises(ValueError, match=words):
            build_parser().parse_args(["serve", "demo", f"--config={cfg}"])
        # `vllm` itself prints such an error as one line, exit code 2
        with pytest.raises(SystemExit) as exc:
            main(["serve", "demo", f"--config={cfg}"])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and words in err and len(err.strip().splitlines()) == 1
