"""The level resolution, cell by cell, against a snapshot taken before the level logic was made
one mechanism (issue 20: base table, then the platform's own level table, then derived rules).

Every level (and none given) x platform (the CPU; CUDA simulated with each attention backend)
x model kind (none, dense, FP8 with static / dynamic scales, MoE) x explicit user setting
resolves to the values (or the error) recorded in `data/level_resolution.json`. The snapshot
was written at commit f28dd5c, where the model runner still narrowed the CUDA-graph mode to
what the attention backend can run *after* resolution; it records the mode that ran (that
narrowing applied, and nothing captured where it ran none), which resolution now decides
itself. Regenerate it (`python -m tests.config.test_level_snapshot --write`) only for a
deliberate change of what a level means, and say which cells changed and why.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.config import model_configs

SNAPSHOT = Path(__file__).parent / "data" / "level_resolution.json"

LEVELS: list[int | None] = [None, 0, 1, 2, 3]
# (VLLM_PLATFORM, VLLM_ATTENTION_BACKEND or None for the platform's default)
PLATFORMS = [("cpu", None), ("cuda", "TORCH_SDPA"), ("cuda", "TRITON_ATTN")]
MODELS = {"none": lambda: None, "dense": model_configs.dense, "fp8": model_configs.fp8,
          "fp8_dynamic": lambda: model_configs.fp8("dynamic"), "moe": model_configs.moe}
ATTN = ["vllm::unified_attention_with_output"]
# name -> (compilation_config, other VllmConfig kwargs, environment)
USER: dict[str, tuple[dict, dict, dict]] = {
    "nothing": ({}, {}, {}),
    "mode=NONE": ({"mode": "NONE"}, {}, {}),
    "mode=STOCK": ({"mode": "STOCK_TORCH_COMPILE"}, {}, {}),
    "mode=VLLM_COMPILE": ({"mode": "VLLM_COMPILE"}, {}, {}),
    **{f"cudagraph_mode={m}": ({"cudagraph_mode": m}, {}, {})
       for m in ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")},
    "splitting_ops=[]": ({"splitting_ops": []}, {}, {}),
    "splitting_ops=attn": ({"splitting_ops": ATTN}, {}, {}),
    "fuse_attn_quant": ({"pass_config": {"fuse_attn_quant": True}}, {}, {}),
    "fuse_norm_quant=False": ({"pass_config": {"fuse_norm_quant": False}}, {}, {}),
    "fuse_allreduce_rms": ({"pass_config": {"fuse_allreduce_rms": True}}, {}, {}),
    "eliminate_noops=False": ({"pass_config": {"eliminate_noops": False}}, {}, {}),
    "max_autotune": ({"max_autotune": True}, {}, {}),
    "compile_sizes=[4,8]": ({"compile_sizes": [4, 8]}, {}, {}),
    "prepack=False": ({"prepack_linear_weights": False}, {}, {}),
    "prepack=True": ({"prepack_linear_weights": True}, {}, {}),
    "cpp_wrapper=False": ({"cpp_wrapper": False}, {}, {}),
    "cpp_wrapper=True": ({"cpp_wrapper": True}, {}, {}),
    "freezing": ({"freezing": True}, {}, {}),
    "backend=eager": ({"backend": "eager"}, {}, {}),
    "capture_sizes=[1,2,4]": ({"cudagraph_capture_sizes": [1, 2, 4]}, {}, {}),
    "tp=2": ({}, {"tensor_parallel_size": 2}, {}),
    "TORCH_COMPILE_DISABLE": ({}, {}, {"TORCH_COMPILE_DISABLE": "1"}),
}
FIELDS = (
    "optimization_level",
    "compilation_config.mode", "compilation_config.cudagraph_mode",
    "compilation_config.use_inductor_graph_partition", "compilation_config.freezing",
    "compilation_config.prepack_linear_weights", "compilation_config.max_autotune",
    "compilation_config.coordinate_descent_tuning", "compilation_config.cpp_wrapper",
    "compilation_config.compile_sizes", "compilation_config.backend",
    "compilation_config.custom_ops", "compilation_config.splitting_ops",
    "compilation_config.cudagraph_capture_sizes",
    "compilation_config.max_cudagraph_capture_size",
    "scheduler_config.max_num_batched_tokens", "scheduler_config.max_num_seqs",
    "model_config.torch_dtype",
    *(f"compilation_config.pass_config.{name}" for name in (
        "eliminate_noops", "fuse_norm_quant", "fuse_act_quant", "fuse_attn_quant",
        "fuse_allreduce_rms", "enable_qk_norm_rope_fusion", "enable_sp", "fuse_gemm_comms",
        "fuse_act_padding", "fuse_mla_dual_rms_norm", "fuse_rope_kvcache",
        "fuse_qk_norm_rope_kvcache", "fuse_rope_kvcache_cat_mla")),
)


def cell_key(level: int | None, platform: str, backend: str | None, model: str,
             user: str) -> str:
    return f"O{level if level is not None else '-'}|{platform}:{backend or 'default'}|" \
           f"{model}|{user}"


def cells():
    for level in LEVELS:
        for platform, backend in PLATFORMS:
            for model in MODELS:
                for user in USER:
                    yield level, platform, backend, model, user


def _jsonable(value: Any) -> Any:
    if hasattr(value, "name") and not isinstance(value, str):
        return value.name
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float)):
        return value
    return str(value)  # a torch.dtype


def resolve(level, platform, backend, model, user, monkeypatch=None):
    """The VllmConfig of one cell, or the exception it raises."""
    from vllm.config import ParallelConfig, VllmConfig
    from vllm.platforms import reset_current_platform

    cc, kwargs, env = USER[user]
    setenv = monkeypatch.setenv if monkeypatch else os.environ.__setitem__
    setenv("VLLM_PLATFORM", platform)
    for name in ("VLLM_ATTENTION_BACKEND", "TORCH_COMPILE_DISABLE"):
        if monkeypatch:
            monkeypatch.delenv(name, raising=False)
        else:
            os.environ.pop(name, None)
    if backend:
        setenv("VLLM_ATTENTION_BACKEND", backend)
    for name, value in env.items():
        setenv(name, value)
    if monkeypatch:  # CUDA is simulated as on a machine without a GPU, also where one is
        import torch

        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    reset_current_platform()
    parallel = ParallelConfig(tensor_parallel_size=kwargs.get("tensor_parallel_size", 1))
    try:
        return VllmConfig(model_config=MODELS[model](), parallel_config=parallel,
                          compilation_config=json.loads(json.dumps(cc)),
                          optimization_level=level)
    except Exception as e:  # noqa: BLE001 - the error is part of the snapshot
        return e


def record(result) -> dict:
    """What the snapshot keeps of one cell: every level-controlled and derived value, or the
    error's message."""
    if isinstance(result, Exception):
        return {"error": str(result).splitlines()[0]}
    out = {}
    for path in FIELDS:
        if path.startswith("model_config") and result.model_config is None:
            continue
        value = result.get_path(path)
        out[path] = _jsonable(value)
    return out


def _matrix() -> dict:
    return {"levels": LEVELS, "platforms": [f"{p}:{b or 'default'}" for p, b in PLATFORMS],
            "models": list(MODELS), "users": list(USER), "fields": list(FIELDS)}


def load_snapshot() -> dict[str, dict]:
    """cell key -> record. The file keeps each field's distinct values once, each distinct
    record once (as indices into those values, or an error's message), and one record index
    per cell in `cells()` order."""
    data = json.loads(SNAPSHOT.read_text())
    assert data["matrix"] == json.loads(json.dumps(_matrix())), \
        "the matrix changed: regenerate the snapshot deliberately"
    fields, values = data["matrix"]["fields"], data["values"]
    records = [rec if isinstance(rec, dict) else
               {f: values[f][i] for f, i in zip(fields, rec) if i is not None}
               for rec in data["records"]]
    keys = [cell_key(*c) for c in cells()]
    assert len(keys) == len(data["cells"])
    return {key: records[i] for key, i in zip(keys, data["cells"])}


def write_snapshot(records_by_cell: dict[str, dict]) -> None:
    values: dict[str, list] = {f: [] for f in FIELDS}
    records: list = []
    index: dict[str, int] = {}
    cell_ids = []
    for key in (cell_key(*c) for c in cells()):
        rec = records_by_cell[key]
        if "error" not in rec:
            row = []
            for f in FIELDS:
                if f not in rec:
                    row.append(None)
                    continue
                if rec[f] not in values[f]:
                    values[f].append(rec[f])
                row.append(values[f].index(rec[f]))
            rec = row
        text = json.dumps(rec)
        if text not in index:
            index[text] = len(records)
            records.append(rec)
        cell_ids.append(index[text])
    SNAPSHOT.parent.mkdir(exist_ok=True)
    lines = ["{", f'"matrix": {json.dumps(_matrix())},', f'"values": {json.dumps(values)},',
             '"records": [', ",\n".join(json.dumps(r, separators=(",", ":")) for r in records),
             "],", f'"cells": {json.dumps(cell_ids, separators=(",", ":"))}', "}"]
    SNAPSHOT.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("level", LEVELS)
def test_resolution_matches_snapshot(level, monkeypatch):
    expected = load_snapshot()
    mismatches = []
    for lvl, platform, backend, model, user in cells():
        if lvl != level:
            continue
        key = cell_key(lvl, platform, backend, model, user)
        got = record(resolve(lvl, platform, backend, model, user, monkeypatch))
        want = expected[key]
        if got != want:
            diff = {k: (want.get(k), got.get(k)) for k in set(want) | set(got)
                    if want.get(k) != got.get(k)}
            mismatches.append(f"{key}: {diff}")
    assert not mismatches, f"{len(mismatches)} cells differ:\n" + "\n".join(mismatches[:20])


def test_snapshot_covers_every_cell():
    expected = load_snapshot()
    assert set(expected) == {cell_key(*c) for c in cells()}
    # Not vacuous: every level and platform resolves, and some cells are errors.
    assert sum("error" in rec for rec in expected.values()) > 0
    assert {rec.get("compilation_config.cudagraph_mode") for rec in expected.values()} >= {
        "NONE", "PIECEWISE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"}


if __name__ == "__main__" and "--write" in sys.argv:
    write_snapshot({cell_key(*c): record(resolve(*c)) for c in cells()})
    print(f"wrote {SNAPSHOT}")
