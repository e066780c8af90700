"""Each platform's own level table: data applied by the code that applies the base table."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.config import model_configs
from vllm.config import CompilationConfig, CUDAGraphMode, VllmConfig
from vllm.config.levels import (
    LEVEL_CONTROLLED_FIELDS,
    OptimizationLevel,
    Setting,
    iter_level_defaults,
    merge_rows,
)
from vllm.config.vllm import DERIVED_FIELDS, ConfigSource
from vllm.platforms.cpu import CpuPlatform
from vllm.platforms.cuda import CudaPlatform
from vllm.platforms.rocm import RocmPlatform

PLATFORM_CLASSES = [CpuPlatform, CudaPlatform, RocmPlatform]
REPORTED = set(LEVEL_CONTROLLED_FIELDS) | set(DERIVED_FIELDS)


def _field_exists(path: str) -> bool:
    *parents, leaf = path.split(".")
    cls = VllmConfig
    for part in parents:
        cls = {f.name: f for f in dataclasses.fields(cls)}[part].default_factory
    return leaf in {f.name for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("cls", PLATFORM_CLASSES)
def test_every_platform_leaf_is_a_reported_field_with_a_reason(cls):
    """A leaf that named no field would be a silent no-op; one outside what `vllm config`
    reports would overwrite an explicit value unseen (only reported leaves record `user`)."""
    for level, row in cls.level_table.items():
        assert isinstance(level, OptimizationLevel)
        for path, leaf in iter_level_defaults(row):
            assert isinstance(leaf, Setting), (level, path)
            assert leaf.reason, (level, path)
            assert path in REPORTED and _field_exists(path), path


@pytest.mark.parametrize("cls", PLATFORM_CLASSES)
def test_no_cuda_graphs_is_said_once_in_the_table(cls):
    """A platform without CUDA graphs pins cudagraph_mode NONE, required, at every level (the
    one place that enforces it); one with them leaves the mode to the levels."""
    pinned = [dict(iter_level_defaults(cls.level_table.get(level, {}))).get(
        "compilation_config.cudagraph_mode") for level in OptimizationLevel]
    if cls(forced=True).support_static_graph_mode():
        assert pinned == [None] * 4
    else:
        assert all(s == Setting(CUDAGraphMode.NONE, s.reason, True) for s in pinned), pinned


def test_platforms_do_not_read_provenance():
    """Platform code is data and capabilities: it never branches on where a value came from."""
    root = Path(__file__).resolve().parents[2] / "vllm" / "platforms"
    for path in root.glob("*.py"):
        assert "provenance" not in path.read_text(), path


@pytest.fixture
def cpu_with_table(cpu_platform, monkeypatch):
    def install(table):
        monkeypatch.setattr(cpu_platform, "level_table", table)
        return cpu_platform
    return install


def test_a_platform_row_replaces_the_level_value_with_its_reason(cpu_with_table):
    O2 = OptimizationLevel.O2
    cpu_with_table(merge_rows(CpuPlatform.level_table, {O2: {"compilation_config": {
        "freezing": Setting(True, "measured x9.99")}}}))
    config = VllmConfig(model_config=model_configs.dense(), optimization_level=2)
    assert config.compilation_config.freezing is True
    prov = config.provenance["compilation_config.freezing"]
    assert (prov.source, prov.name, prov.reason) == (ConfigSource.PLATFORM, "cpu",
                                                     "measured x9.99")
    assert prov.label == "platform cpu"
    # Other levels are untouched; an explicit value wins over the row.
    assert VllmConfig(optimization_level=1).compilation_config.freezing is False
    explicit = VllmConfig(optimization_level=2, compilation_config=CompilationConfig(
        freezing=False))
    assert explicit.compilation_config.freezing is False
    assert explicit.provenance["compilation_config.freezing"].source is ConfigSource.USER


def test_a_required_row_refuses_a_different_explicit_value(cpu_with_table):
    cpu_with_table({level: {"compilation_config.max_autotune": Setting(
        False, "no such tuner here", required=True)} for level in OptimizationLevel})
    assert VllmConfig(optimization_level=3).compilation_config.max_autotune is False
    with pytest.raises(ValueError, match="max_autotune=True cannot be honoured on the cpu "
                       "platform: no such tuner here. Leave max_autotune unset or set it to "
                       "False there."):
        VllmConfig(optimization_level=3, compilation_config={"max_autotune": True})
    # The same value, given explicitly, is fine (and stays the user's).
    same = VllmConfig(optimization_level=3, compilation_config={"max_autotune": False})
    assert same.provenance["compilation_config.max_autotune"].source is ConfigSource.USER


def test_a_predicate_in_a_row_is_asked_like_the_base_tables(cpu_with_table):
    def small_vocab(cfg) -> bool:
        """vocabulary under 1000 tokens"""
        return cfg.model_config.get_vocab_size() < 1000

    cpu_with_table({OptimizationLevel.O1: {"compilation_config": {"pass_config": {
        "eliminate_noops": Setting(small_vocab, "measured")}}}})
    config = VllmConfig(model_config=model_configs.dense(), optimization_level=1)
    assert config.compilation_config.pass_config.eliminate_noops is True
    assert config.provenance["compilation_config.pass_config.eliminate_noops"].reason == (
        "vocabulary under 1000 tokens: yes; measured")


def test_cpu_table_holds_what_the_base_table_leaves_to_platforms():
    """The base table has no platform conditions: prepacking and the C++ wrapper are off there
    and on in the CPU's O2/O3 rows, with their measurements."""
    from vllm.config.levels import OPTIMIZATION_LEVEL_TO_CONFIG

    for level in OptimizationLevel:
        base = dict(iter_level_defaults(OPTIMIZATION_LEVEL_TO_CONFIG[level]))
        assert base["compilation_config.prepack_linear_weights"] is False
        assert base["compilation_config.cpp_wrapper"] is False
        assert not any(callable(v) and "cpu" in v.__name__ for v in base.values())
        cpu = dict(iter_level_defaults(CpuPlatform.level_table[level]))
        for name in ("prepack_linear_weights", "cpp_wrapper"):
            leaf = cpu.get(f"compilation_config.{name}")
            if level >= 2:
                assert leaf.value is True and " x1." in leaf.reason
            else:
                assert leaf is None


def test_a_required_predicate_is_asked_before_refusing(cpu_with_table):
    def never(cfg) -> bool:
        """this platform has the tuner"""
        return False

    cpu_with_table({OptimizationLevel.O3: {"compilation_config.max_autotune": Setting(
        never, "checked at start", required=True)}})
    with pytest.raises(ValueError, match="max_autotune=True cannot be honoured.*set it to "
                       "False there"):
        VllmConfig(optimization_level=3, compilation_config={"max_autotune": True})
    assert VllmConfig(optimization_level=3, compilation_config={
        "max_autotune": False}).compilation_config.max_autotune is False
