// The instruction-set level a CPU kernel library was compiled for, in vllm/utils/cpu_info.py's
// names: every library's `isa()` op returns it. vllm/utils/cpu_kernels.py pastes this file in
// place of a source's `#include "cpu_isa_level.h"` line (the build compiles one file).
std::string isa_level() {
#if defined(__AVX512BF16__)
  return "avx512_bf16";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "native";
#endif
}
