#!/usr/bin/env bash
# The CUDA checks, in one run on a machine with a GPU (CI has none: there these tests skip).
#
#   bash scripts/device_check.sh [OUT_DIR]
#
# 1. the CUDA-marked tests (real CUDA graphs, Triton kernels, -O0..-O3 end to end on the GPU),
#    and at the same time the whole suite with the GPU visible (every engine test then runs
#    on CUDA), on many workers;
# 2. bench_levels.py on the GPU: demo model (float32) and the Qwen2.5-0.5B shape (bfloat16).
# Logs, JUnit XML and benchmark tables go to OUT_DIR (default $OUT, else /tmp/device_check).
# Wheels in .whl/ (packages the machine lacks) are installed first when present.
set -u
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-/tmp/device_check}}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT_DIR/install.log" 2>&1
{
    date; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_capability())"
    python3 -c "import vllm, vllm.platforms as p; print('vllm', vllm.__file__, p.current_platform)"
    which gcc g++ nvcc
} >"$OUT_DIR/env.txt" 2>&1

stage() {  # name, seconds, command...
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout -k 5 "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
    echo "$name: rc=$? in $((SECONDS - start)) s" | tee -a "$OUT_DIR/stages.txt"
    pkill -9 -f benchmarks/bench_levels.py 2>/dev/null  # workers a timeout left behind
}

SUITE_S=${SUITE_S:-220}
# -v: each test's outcome is in the log as it ends, even if the stage is cut short.
stage suite "$SUITE_S" python3 -m pytest -v --tb=short -n 14 -m "not cuda" \
    -p no:cacheprovider --timeout 100 -rfE --junitxml="$OUT_DIR/suite.xml" &
stage cuda_tests "$SUITE_S" python3 -m pytest -v --tb=short -m cuda -p no:cacheprovider -rfE \
    --junitxml="$OUT_DIR/cuda_tests.xml" tests/engine/test_cuda_e2e.py \
    tests/compile/test_cuda_graph_wrapper.py tests/quantization/test_fp8_ops.py \
    tests/attention/test_sliding_window_attention.py
wait
stage bench_demo "${BENCH_DEMO_S:-100}" python3 benchmarks/bench_levels.py --models demo \
    --warm-runs 1 --repeats 3 --threads 8 --out "$OUT_DIR/cuda_levels_demo"
stage bench_qwen "${BENCH_QWEN_S:-110}" python3 benchmarks/bench_levels.py \
    --models qwen2.5-0.5b --levels 0 1 2 --dtype bfloat16 --warm-runs 1 --repeats 3 \
    --threads 8 --ckpt-root /tmp/ckpt --out "$OUT_DIR/cuda_levels_qwen"
cat "$OUT_DIR/env.txt" "$OUT_DIR/stages.txt"
grep -h -o -E "(FAILED|ERROR) tests/[^ ]*( - .*)?" "$OUT_DIR/cuda_tests.log" "$OUT_DIR/suite.log" \
    | cut -c1-240 | sort -u
grep -h -E "passed|failed" "$OUT_DIR/cuda_tests.log" "$OUT_DIR/suite.log" | tail -2
cat "$OUT_DIR"/cuda_levels_*.md 2>/dev/null
