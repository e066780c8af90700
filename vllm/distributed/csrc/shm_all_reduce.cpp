// All-reduce over a POSIX shared-memory segment, for tensor-parallel ranks on one host.
//
//   h = torch.ops.vllm_shm_ar.attach(name, slot_bytes, rank, world, create)  -> handle
//   torch.ops.vllm_shm_ar.unlink(name)            // once every rank is attached
//   torch.ops.vllm_shm_ar.detach(h)
//   y = torch.ops.vllm_shm_ar.all_reduce(x, h)    // sum over the ranks (float32, bfloat16, half)
//   out, res = torch.ops.vllm_shm_ar.all_reduce_rms_norm(x, residual?, weight, eps, scale?, h)
//
// Segment layout: a header (one cache line per rank holding its arrival counter and pid), then
// for each rank two slots of `slot_bytes` (double buffering). A call with generation g (the
// count of calls on this handle, the same on every rank because every rank makes the same
// calls in the same order) goes:
//   1. copy x into this rank's slot g % 2;
//   2. store g into this rank's counter (release);
//   3. wait until every rank's counter is >= g (acquire): spin briefly, then yield, then
//      sleep with a growing back-off, checking that the other ranks' processes are alive;
//   4. sum the ranks' slots in rank order (every rank computes the same bits) into the output.
// Rank r writes slot g % 2 again only at call g + 2, after every rank arrived at call g + 1,
// i.e. after every rank finished reading call g: two slots are enough, with no second barrier.
//
// The fused op sums a row, adds the residual, writes the new residual, normalises (RMSNorm
// with weight) and optionally quantises to FP8 with a static scale, while the row is in
// cache: the reduced activations are read once. The dtype roundings follow RMSNorm's native
// form (vllm/model_executor/layers/layernorm.py): reduced sum rounded to the model dtype, the
// residual add and the norm in float32, the normalised value rounded before the weight.
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define VLLM_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define VLLM_CPU_RELAX() asm volatile("yield" ::: "memory")
#else
#define VLLM_CPU_RELAX() ((void)0)
#endif

namespace {

constexpr uint64_t kMagic = 0x766c6c6d5f617231ULL;  // "vllm_ar1"
constexpr int64_t kMaxWorld = 64;
constexpr size_t kLine = 64;

struct alignas(kLine) RankLine {
  std::atomic<uint64_t> arrived;
  int64_t pid;
};

struct alignas(kLine) Header {
  uint64_t magic;
  int64_t world;
  int64_t slot_bytes;
  RankLine ranks[kMaxWorld];
};

struct Mapping {
  void* base = nullptr;
  size_t size = 0;
  int64_t rank = 0;
  int64_t world = 0;
  int64_t slot_bytes = 0;
  uint64_t generation = 0;
  std::vector<int64_t> pids;
  Header* header() const { return static_cast<Header*>(base); }
  char* slot(int64_t r, uint64_t gen) const {
    char* data = static_cast<char*>(base) + sizeof(Header);
    return data + (r * 2 + static_cast<int64_t>(gen & 1)) * slot_bytes;
  }
};

std::mutex g_mutex;
std::vector<std::unique_ptr<Mapping>> g_maps;

double timeout_seconds() {
  const char* text = std::getenv("VLLM_SHM_ALLREDUCE_TIMEOUT_S");
  if (text != nullptr) {
    char* end = nullptr;
    double value = std::strtod(text, &end);
    if (end != text && value > 0) return value;
  }
  return 1800.0;  // as torch.distributed's default process-group timeout
}

size_t segment_size(int64_t world, int64_t slot_bytes) {
  return sizeof(Header) + static_cast<size_t>(world) * 2 * static_cast<size_t>(slot_bytes);
}

Mapping& get(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_mutex);
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(g_maps.size()) && g_maps[handle],
              "shared-memory all-reduce: no attached segment with handle ", handle);
  return *g_maps[handle];
}

int64_t attach(const std::string& name, int64_t slot_bytes, int64_t rank, int64_t world,
               bool create) {
  TORCH_CHECK(world >= 1 && world <= kMaxWorld, "shared-memory all-reduce: world size ", world,
              " is not in [1, ", kMaxWorld, "]");
  TORCH_CHECK(rank >= 0 && rank < world, "shared-memory all-reduce: rank ", rank,
              " is not in a world of ", world);
  TORCH_CHECK(slot_bytes > 0 && slot_bytes % kLine == 0,
              "shared-memory all-reduce: slot_bytes must be a positive multiple of 64, got ",
              slot_bytes);
  const size_t size = segment_size(world, slot_bytes);
  int fd = create ? shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600)
                  : shm_open(name.c_str(), O_RDWR, 0600);
  TORCH_CHECK(fd >= 0, "shared-memory all-reduce: shm_open(", name, ") failed: ",
              std::strerror(errno));
  if (create && ftruncate(fd, static_cast<off_t>(size)) != 0) {
    int err = errno;
    close(fd);
    shm_unlink(name.c_str());
    TORCH_CHECK(false, "shared-memory all-reduce: ftruncate(", name, ", ", size,
                ") failed: ", std::strerror(err));
  }
  if (!create) {
    struct stat st;
    TORCH_CHECK(fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) >= size,
                "shared-memory all-reduce: segment ", name, " is smaller than ", size, " bytes");
  }
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  close(fd);
  if (base == MAP_FAILED) {
    if (create) shm_unlink(name.c_str());
    TORCH_CHECK(false, "shared-memory all-reduce: mmap of ", size, " bytes failed: ",
                std::strerror(err));
  }
  auto* header = static_cast<Header*>(base);
  if (create) {
    // The header only; the slots are written before they are read. (ftruncate zero-fills.)
    header->world = world;
    header->slot_bytes = slot_bytes;
    for (int64_t r = 0; r < kMaxWorld; ++r) {
      header->ranks[r].arrived.store(0, std::memory_order_relaxed);
      header->ranks[r].pid = 0;
    }
    std::atomic_thread_fence(std::memory_order_release);
    header->magic = kMagic;
  } else {
    TORCH_CHECK(header->magic == kMagic && header->world == world &&
                    header->slot_bytes == slot_bytes,
                "shared-memory all-reduce: segment ", name,
                " was not set up for this group (world ", world, ", slot bytes ", slot_bytes,
                ")");
  }
  header->ranks[rank].pid = static_cast<int64_t>(getpid());
  auto map = std::make_unique<Mapping>();
  map->base = base;
  map->size = size;
  map->rank = rank;
  map->world = world;
  map->slot_bytes = slot_bytes;
  std::lock_guard<std::mutex> lock(g_mutex);
  g_maps.push_back(std::move(map));
  return static_cast<int64_t>(g_maps.size()) - 1;
}

void unlink_segment(const std::string& name) {
  if (shm_unlink(name.c_str()) != 0 && errno != ENOENT) {
    TORCH_CHECK(false, "shared-memory all-reduce: shm_unlink(", name, ") failed: ",
                std::strerror(errno));
  }
}

void detach(int64_t handle) {
  std::unique_ptr<Mapping> map;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (handle < 0 || handle >= static_cast<int64_t>(g_maps.size())) return;
    map = std::move(g_maps[handle]);
  }
  if (map && map->base != nullptr) munmap(map->base, map->size);
}

// Whether process `pid` is gone: no such process, or a zombie (a worker that died before its
// parent, often this rank's process, reaped it).
bool process_gone(int64_t pid) {
  if (pid <= 0) return false;
  if (kill(static_cast<pid_t>(pid), 0) != 0) return errno == ESRCH;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text;
  if (!std::getline(stat, text)) return false;
  const size_t paren = text.rfind(')');
  if (paren == std::string::npos || paren + 2 >= text.size()) return false;
  const char state = text[paren + 2];
  return state == 'Z' || state == 'X';
}

// Releases the GIL (if this thread holds it) for a long wait, so the process's other Python
// threads (the engine's health monitor, a server's event loop) run meanwhile; takes it back
// on leaving the scope, also when the wait throws.
struct GilRelease {
  PyThreadState* state = nullptr;
  void release() {
    if (state == nullptr && Py_IsInitialized() && PyGILState_Check()) state = PyEval_SaveThread();
  }
  ~GilRelease() {
    if (state != nullptr) PyEval_RestoreThread(state);
  }
};

// Step 3: wait until every rank arrived at `gen`. Spins ~a few microseconds (a decode-sized
// all-reduce usually completes within that), then yields the core, then sleeps with a growing
// back-off (up to 1 ms) so that a rank waiting for a slow peer (a compile) burns no core.
void wait_all(Mapping& m, uint64_t gen) {
  Header* h = m.header();
  if (m.pids.empty()) {
    m.pids.resize(m.world);
    for (int64_t r = 0; r < m.world; ++r) m.pids[r] = h->ranks[r].pid;
  }
  using clock = std::chrono::steady_clock;
  for (int64_t r = 0; r < m.world; ++r) {
    if (r == m.rank) continue;
    std::atomic<uint64_t>& flag = h->ranks[r].arrived;
    if (flag.load(std::memory_order_acquire) >= gen) continue;
    int spins = 0;
    for (; spins < 4096; ++spins) {
      if (flag.load(std::memory_order_acquire) >= gen) break;
      VLLM_CPU_RELAX();
    }
    if (spins < 4096) continue;
    GilRelease gil;
    gil.release();
    const auto start = clock::now();
    auto last_check = start;
    long sleep_ns = 1000;
    uint64_t round = 0;
    while (flag.load(std::memory_order_acquire) < gen) {
      if (++round < 2000) {
        sched_yield();
        continue;
      }
      struct timespec ts = {0, sleep_ns};
      nanosleep(&ts, nullptr);
      sleep_ns = std::min(sleep_ns * 2, 1000000L);
      const auto now = clock::now();
      if (now - last_check > std::chrono::milliseconds(100)) {
        last_check = now;
        const int64_t pid = m.pids[r];
        if (process_gone(pid)) {
          TORCH_CHECK(false, "shared-memory all-reduce: tensor-parallel rank ", r, " (pid ",
                      pid, ") exited while rank ", m.rank, " waited for it");
        }
        const double waited = std::chrono::duration<double>(now - start).count();
        if (waited > timeout_seconds()) {
          TORCH_CHECK(false, "shared-memory all-reduce: rank ", m.rank, " waited ", waited,
                      " s for tensor-parallel rank ", r, " (pid ", pid,
                      "); VLLM_SHM_ALLREDUCE_TIMEOUT_S sets the limit");
        }
      }
    }
  }
}

// Steps 1-3; returns the generation whose slots hold every rank's data.
uint64_t exchange(Mapping& m, const at::Tensor& x) {
  const int64_t nbytes = x.numel() * x.element_size();
  TORCH_CHECK(nbytes <= m.slot_bytes, "shared-memory all-reduce: ", nbytes,
              " bytes exceed the slot of ", m.slot_bytes, " bytes");
  const uint64_t gen = ++m.generation;
  std::memcpy(m.slot(m.rank, gen), x.data_ptr(), static_cast<size_t>(nbytes));
  m.header()->ranks[m.rank].arrived.store(gen, std::memory_order_release);
  wait_all(m, gen);
  return gen;
}

template <typename T>
inline float to_f(T v) {
  return static_cast<float>(v);
}

template <typename T>
void sum_range(const Mapping& m, uint64_t gen, T* out, int64_t begin, int64_t end) {
  const T* first = reinterpret_cast<const T*>(m.slot(0, gen));
  if (m.world == 1) {
    std::memcpy(out + begin, first + begin, (end - begin) * sizeof(T));
    return;
  }
  float acc[256];
  for (int64_t i = begin; i < end; i += 256) {
    const int64_t n = std::min<int64_t>(256, end - i);
    for (int64_t k = 0; k < n; ++k) acc[k] = to_f(first[i + k]);
    for (int64_t r = 1; r < m.world; ++r) {
      const T* src = reinterpret_cast<const T*>(m.slot(r, gen)) + i;
      for (int64_t k = 0; k < n; ++k) acc[k] += to_f(src[k]);
    }
    for (int64_t k = 0; k < n; ++k) out[i + k] = static_cast<T>(acc[k]);
  }
}

template <typename Fn>
void dispatch(const at::Tensor& x, Fn&& fn) {
  switch (x.scalar_type()) {
    case at::kFloat:
      fn(static_cast<float*>(nullptr));
      break;
    case at::kBFloat16:
      fn(static_cast<c10::BFloat16*>(nullptr));
      break;
    case at::kHalf:
      fn(static_cast<c10::Half*>(nullptr));
      break;
    default:
      TORCH_CHECK(false, "shared-memory all-reduce: dtype ", x.scalar_type(),
                  " is not supported (float32, bfloat16, float16 are)");
  }
}

// Elements per thread chunk: decode sizes (a few thousand to ~64K elements) stay on one
// thread, where waking the pool would cost more than the sum.
constexpr int64_t kGrain = 1 << 16;

at::Tensor all_reduce(const at::Tensor& x_in, int64_t handle) {
  TORCH_CHECK(x_in.device().is_cpu(), "shared-memory all-reduce: the tensor must be on the CPU");
  Mapping& m = get(handle);
  at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty_like(x);
  if (x.numel() == 0) return out;
  dispatch(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const uint64_t gen = exchange(m, x);
    T* dst = out.data_ptr<T>();
    at::parallel_for(0, x.numel(), kGrain, [&](int64_t b, int64_t e) {
      sum_range<T>(m, gen, dst, b, e);
    });
  });
  return out;
}

template <typename T, typename Q>
void fused_rows(const Mapping& m, uint64_t gen, int64_t rows, int64_t n, const T* residual,
                const T* weight, float eps, float scale, T* res_out, Q* out) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kGrain / std::max<int64_t>(n, 1)),
                   [&](int64_t r0, int64_t r1) {
    std::vector<float> s(n);
    for (int64_t row = r0; row < r1; ++row) {
      const int64_t off = row * n;
      // The reduced row, rounded to the model dtype (the all-reduce's output).
      sum_range<T>(m, gen, res_out, off, off + n);
      const T* red = res_out + off;
      float sq = 0.f;
      for (int64_t k = 0; k < n; ++k) {
        float v = to_f(red[k]);
        if (residual != nullptr) v += to_f(residual[off + k]);
        s[k] = v;
        sq += v * v;
      }
      if (residual != nullptr)
        for (int64_t k = 0; k < n; ++k) res_out[off + k] = static_cast<T>(s[k]);
      const float inv = 1.0f / std::sqrt(sq / static_cast<float>(n) + eps);
      for (int64_t k = 0; k < n; ++k) {
        T y = static_cast<T>(s[k] * inv);
        if (weight != nullptr) y = static_cast<T>(to_f(y) * to_f(weight[k]));
        if constexpr (std::is_same_v<Q, c10::Float8_e4m3fn>) {
          float q = to_f(y) / scale;
          q = std::min(448.0f, std::max(-448.0f, q));
          out[off + k] = c10::Float8_e4m3fn(q);
        } else {
          out[off + k] = y;
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> all_reduce_rms_norm(const at::Tensor& x_in,
                                                       const std::optional<at::Tensor>& residual_in,
                                                       const at::Tensor& weight_in, double eps,
                                                       const std::optional<at::Tensor>& scale,
                                                       int64_t handle) {
  TORCH_CHECK(x_in.device().is_cpu(), "shared-memory all-reduce: the tensor must be on the CPU");
  TORCH_CHECK(x_in.dim() >= 1, "all_reduce_rms_norm needs at least one dimension");
  Mapping& m = get(handle);
  at::Tensor x = x_in.contiguous();
  const int64_t n = x.size(-1);
  const int64_t rows = n == 0 ? 0 : x.numel() / n;
  at::Tensor residual;
  if (residual_in.has_value() && residual_in->defined()) {
    residual = residual_in->contiguous();
    TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
                "all_reduce_rms_norm: the residual must match x in shape and dtype");
  }
  at::Tensor weight = weight_in.contiguous();
  TORCH_CHECK(weight.numel() == n && weight.scalar_type() == x.scalar_type(),
              "all_reduce_rms_norm: the weight must have ", n, " elements of x's dtype");
  const bool quant = scale.has_value() && scale->defined();
  float scale_value = 1.0f;
  if (quant) {
    TORCH_CHECK(scale->numel() == 1, "static FP8 quantization needs a one-element scale");
    scale_value = scale->to(at::kFloat).item<float>();
  }
  at::Tensor res_out = at::empty_like(x);
  at::Tensor out = quant ? at::empty(x.sizes(), x.options().dtype(at::kFloat8_e4m3fn))
                         : at::empty_like(x);
  if (x.numel() == 0) return {out, res_out};
  dispatch(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const uint64_t gen = exchange(m, x);
    const T* res = residual.defined() ? residual.data_ptr<T>() : nullptr;
    if (quant) {
      fused_rows<T, c10::Float8_e4m3fn>(m, gen, rows, n, res, weight.data_ptr<T>(),
                                        static_cast<float>(eps), scale_value,
                                        res_out.data_ptr<T>(),
                                        static_cast<c10::Float8_e4m3fn*>(out.data_ptr()));
    } else {
      fused_rows<T, T>(m, gen, rows, n, res, weight.data_ptr<T>(), static_cast<float>(eps),
                       scale_value, res_out.data_ptr<T>(), out.data_ptr<T>());
    }
  });
  return {out, res_out};
}

}  // namespace

TORCH_LIBRARY(vllm_shm_ar, m) {
  m.def("attach(str name, int slot_bytes, int rank, int world, bool create) -> int", &attach);
  m.def("unlink(str name) -> ()", &unlink_segment);
  m.def("detach(int handle) -> ()", &detach);
  m.def("all_reduce(Tensor x, int handle) -> Tensor", &all_reduce);
  m.def("all_reduce_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps, "
        "Tensor? scale, int handle) -> (Tensor, Tensor)",
        &all_reduce_rms_norm);
}
