"""A compile says what it is doing: one line when a piece starts compiling, one when it is
done ("Compiled piece 2/3 ... in 4.1 s"), progress lines in between (vllm/utils/progress.py);
pieces loaded from the compile cache log nothing unless the load is slow."""
from __future__ import annotations

import logging
import re

import pytest
import torch
from test_backend import build, inputs, make_config

from vllm.compilation.counter import compilation_counter

LOGGER = "vllm.compilation.backends"
HIDDEN = 12


@pytest.fixture(autouse=True)
def _fresh_dynamo(monkeypatch):
    monkeypatch.setenv("VLLM_TEST_FAIL_ON_RECOMPILE", "1")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def piece_lines(caplog) -> list[str]:
    """The start and end lines of the pieces (not the progress lines in between, which a slow
    machine adds)."""
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and re.match(r"(Compiling|Compiled|Loading|Loaded) piece",
                                             r.getMessage())
            and not r.getMessage().endswith(" s so far")]


def test_each_piece_compile_logs_its_start_and_its_end(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    config = make_config(compile_ranges_endpoints=[], compile_sizes=[4])
    max_tokens = config.scheduler_config.max_num_batched_tokens
    model = build(config, num_attn=3)
    with torch.no_grad():
        model(*inputs(8))
    # 3 attention layers: 7 pieces, of which the 4 between them (indices 0, 2, 4, 6) compile.
    lines = piece_lines(caplog)
    expected = []
    for place, index in enumerate((0, 2, 4, 6), start=1):
        # The range, then (statically, at the same first forward) the compile size.
        for tokens in (f"tokens [1, {max_tokens}]", "4 tokens"):
            what = f"piece {place}/4 (graph piece {index}, {tokens}) with eager"
            expected += [f"Compiling {what} ...", f"Compiled {what} in"]
    assert [line if line.endswith(" ...") else line[:line.rindex(" in ") + 3]
            for line in lines] == expected
    assert all(re.search(r" in \d+\.\d s$", line) for line in lines[1::2])
    caplog.clear()
    # A call of the compile size compiles nothing more.
    with torch.no_grad(), compilation_counter.expect(num_backend_compilations=0):
        model(*inputs(4))
    assert piece_lines(caplog) == []


def test_the_piece_label_names_its_place_among_the_compiled_pieces():
    from vllm.compilation.backends import VllmBackend
    from vllm.compilation.split import SplitItem
    from vllm.config.utils import Range

    backend = VllmBackend(make_config())
    backend.pieces = [SplitItem(i, f"submod_{i}", i % 2 == 1, None) for i in range(5)]
    assert backend.piece_label(4, Range(1, 2048)) == \
        "piece 3/3 (graph piece 4, tokens [1, 2048]) with eager"
    assert backend.piece_label(2, Range(16, 16)) == \
        "piece 2/3 (graph piece 2, 16 tokens) with eager"
    backend.pieces = []  # not from a split (a direct call): the index alone
    assert backend.piece_label(7, Range(1, 8)).startswith("piece 7 (graph piece 7,")


@pytest.mark.slow
def test_inductor_compiles_log_and_cache_hits_stay_quiet(tmp_path, monkeypatch, caplog):
    """The first start compiles each distinct piece with Inductor (the middle ones share one
    compile: no lines); the next start loads everything from the compile cache in well under
    the 2 s before a progress line, and logs no piece lines."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    caplog.set_level(logging.INFO, logger=LOGGER)
    config = make_config(backend="inductor", compile_ranges_endpoints=[])
    ids, pos = inputs(8)
    # (hidden=12: kernels of their own. Inductor reuses a C++ kernel module already loaded
    # in the process by name, so a toy that shares kernels with another test's would leave
    # that test's cache without them: inductor_light then cannot load them without Inductor.)
    with torch.no_grad():
        model = build(config, num_attn=3, hidden=HIDDEN)
        expected = model(ids, pos)
    lines = piece_lines(caplog)
    starts = [line for line in lines if line.startswith("Compiling")]
    ends = [line for line in lines if line.startswith("Compiled")]
    assert starts and len(starts) == len(ends) == len(lines) // 2
    assert all(line.endswith(" with inductor ...") for line in starts)
    assert all(re.fullmatch(r"Compiled piece \d/4 .* with inductor in \d+\.\d s", line)
               for line in ends)
    assert starts[0].startswith("Compiling piece 1/4 (graph piece 0,")
    caplog.clear()
    torch._dynamo.reset()
    with torch.no_grad(), compilation_counter.expect(num_inductor_compiles=0):
        again = build(config, num_attn=3, hidden=HIDDEN)
        torch.testing.assert_close(again(ids, pos), expected)
    assert piece_lines(caplog) == []
