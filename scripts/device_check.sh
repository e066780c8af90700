#!/usr/bin/env bash
# The CUDA checks, in one run on a machine with a GPU (CI has none: there these tests skip).
#
#   bash scripts/device_check.sh [OUT_DIR]
#
# 1. the CUDA-marked tests but -O3 (real CUDA graphs, full ones for decode with TRITON_ATTN,
#    Triton kernels, -O0..-O2 end to end on the GPU) and the TRITON_ATTN tests, and, at the
#    same time, the whole suite with the GPU visible (every engine test then runs on CUDA) on
#    many workers;
# 2. -O3 on CUDA alone (Inductor max-autotune: minutes of start-up), with its duration;
# 3. bench_levels.py on the GPU: the demo model (float32) and the Qwen2.5-0.5B shape (bf16).
# Each stage has a time limit (env SUITE_S, O3_S, BENCH_DEMO_S, BENCH_QWEN_S). Outcomes go to
# OUT_DIR (default $OUT, else /tmp/device_check) as they happen: pytest-reportlog JSON lines
# (tracebacks included, even when a stage is cut short), logs and benchmark tables.
#
# Packages the machine lacks travel as wheels in .whl/ (installed first when present):
# `bash scripts/device_wheels.sh` fetches them here; the run carries ".whl". Last run
# (2026-12-04, torch 2.11+cu130): -O1/-O2 CUDA graph replays (full graphs for decode) and the
# Triton kernels passed; -O3's cold start of the 2-layer test model exceeded 200 s.
set -u
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-/tmp/device_check}}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 USE_HUB_KERNELS=0
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT_DIR/install.log" 2>&1
{
    date; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_capability())"
    python3 -c "import vllm, vllm.platforms as p; print('vllm', vllm.__file__, p.current_platform)"
} >"$OUT_DIR/env.txt" 2>&1
REPORT=()
python3 -c "import pytest_reportlog" 2>/dev/null && REPORT=(--report-log)

stage() {  # name, seconds, command...
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout -k 5 "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
    echo "$name: rc=$? in $((SECONDS - start)) s" | tee -a "$OUT_DIR/stages.txt"
    pkill -9 -f benchmarks/bench_levels.py 2>/dev/null  # workers a timeout left behind
}

O3_TEST="tests/engine/test_cuda_e2e.py::test_compiled_level_replays_cuda_graphs_and_matches_o0[3]"
SUITE_S=${SUITE_S:-240}
stage suite "$SUITE_S" python3 -m pytest -q --tb=short -n 14 -m "not cuda" \
    -p no:cacheprovider --timeout 150 -rfE ${REPORT:+"${REPORT[@]}" "$OUT_DIR/suite.jsonl"} &
stage cuda_tests "$SUITE_S" python3 -m pytest -v --tb=short -m cuda -p no:cacheprovider -rfE \
    ${REPORT:+"${REPORT[@]}" "$OUT_DIR/cuda_tests.jsonl"} --deselect "$O3_TEST" \
    tests/engine/test_cuda_e2e.py tests/compile/test_cuda_graph_wrapper.py \
    tests/quantization/test_fp8_ops.py tests/attention/test_sliding_window_attention.py \
    tests/attention/test_triton_attn.py
wait
stage cuda_o3 "${O3_S:-240}" python3 -m pytest -v --tb=short -p no:cacheprovider --durations=3 \
    "$O3_TEST"
stage bench_demo "${BENCH_DEMO_S:-150}" python3 benchmarks/bench_levels.py --models demo \
    --levels 0 1 2 --warm-runs 1 --repeats 3 --threads 8 --out "$OUT_DIR/cuda_levels_demo"
stage bench_qwen "${BENCH_QWEN_S:-150}" python3 benchmarks/bench_levels.py \
    --models qwen2.5-0.5b --levels 0 1 2 --dtype bfloat16 --warm-runs 1 --repeats 3 \
    --threads 8 --ckpt-root /tmp/ckpt --out "$OUT_DIR/cuda_levels_qwen"
cat "$OUT_DIR/env.txt" "$OUT_DIR/stages.txt"
grep -h -o -E "(FAILED|ERROR) tests/[^ ]*( - .*)?" "$OUT_DIR"/suite.log "$OUT_DIR"/cuda*.log \
    | cut -c1-240 | sort -u
grep -h -E "passed|failed" "$OUT_DIR"/cuda*.log "$OUT_DIR/suite.log" | tail -3
cat "$OUT_DIR"/cuda_levels_*.md 2>/dev/null
