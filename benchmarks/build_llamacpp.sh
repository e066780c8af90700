#!/usr/bin/env bash
# Build llama.cpp's shared libraries for one x86 instruction-set level, from the source of the
# llama-cpp-python version installed here (so its Python bindings match), for
# `bench_vs_llamacpp.py --isa avx2`: an AVX-512 machine then measures both engines as an
# AVX2-only CPU would run them.
#
#   bash benchmarks/build_llamacpp.sh avx2 [OUT_DIR]     # default OUT_DIR: benchmarks/results/tmp/llamacpp-avx2
#   LLAMA_CPP_LIB_PATH=OUT_DIR/build/bin python benchmarks/bench_vs_llamacpp.py --isa avx2 ...
#
# Needs cmake, a C++ compiler and the package index (pip download of the sdist). Takes a few
# minutes on two cores.
set -euo pipefail
level="${1:-}"
case "$level" in
  avx2) flags=(-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
               -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF
               -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF
               -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF) ;;
  *) echo "usage: $0 avx2 [OUT_DIR] (the level to build llama.cpp for; got '${level}')" >&2
     exit 2 ;;
esac
here="$(cd "$(dirname "$0")" && pwd)"
out="$(mkdir -p "${2:-$here/results/tmp/llamacpp-$level}" && cd "${2:-$here/results/tmp/llamacpp-$level}" && pwd)"
version="$(python3 -c 'import llama_cpp; print(llama_cpp.__version__)')"
src="$out/src"
if [ ! -d "$src/vendor/llama.cpp" ]; then
  echo "fetching the llama-cpp-python $version source"
  tmp="$(mktemp -d)"
  python3 -m pip download --quiet --no-binary :all: --no-deps "llama-cpp-python==$version" -d "$tmp"
  mkdir -p "$src"
  tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$src" --strip-components=1
  rm -rf "$tmp"
fi
cmake -S "$src/vendor/llama.cpp" -B "$out/build" -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=OFF -DGGML_OPENMP=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
  -DLLAMA_BUILD_SERVER=OFF "${flags[@]}" >/dev/null
cmake --build "$out/build" --target llama -j "$(nproc)"
ls "$out/build/bin"/libllama.so >/dev/null  # (llama.cpp puts its libraries there)
echo "built llama.cpp $version for $level: LLAMA_CPP_LIB_PATH=$out/build/bin"
