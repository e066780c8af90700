"""Linear weights packed once into column panels, used by compiled graphs through an opaque op.

Inductor lowers a float32 `F.linear` on the CPU to MKL's sgemm, which on the dev machines runs
decode-sized products several times slower than oneDNN on a weight reordered into its blocked
layout (16 x 256 -> 768: MKL 113 us, oneDNN on the plain weight 51 us, on the reordered weight
28 us). Inductor freezing does such a reorder, but it folds the weights into the compiled code
as mkldnn tensors, which neither Inductor's cache nor ours can save: every start compiles
again. Here the weights stay graph inputs, so the compiled code holds no weight and is
cached like any other:
  - `prepack(weight)` packs one loaded weight (after loading, once) into column panels
    (`vllm_cpu_linear::pack_panels`: 16 output columns by K each, csrc/cpu_panel_linear.h) and
    hands the copy to the C++ linear dispatcher (`vllm_cpu_linear::set_packed`), keyed by the
    weight's storage, until the parameter is freed. (The copy used to be oneDNN's reorder;
    the panel kernel runs batched-decode products 1.4-1.5x faster at 12-16 rows, and
    one copy of the weights is all the memory a level may add.) The engine queues its weights
    with `prepack_in_background` as they load, and when it is ready
    (`finish_prepacking_in_background()`) a thread packs them (the op releases the GIL) while
    the engine serves: products with a weight not packed yet take the plain weight's routes
    (equal up to float rounding), and the thread logs when it is done and ends. On the
    Qwen2.5-0.5B shape packing takes ~1-3 s of the two cores. Waiting for it before ready
    made a warm -O2 start ~0.7 s longer; packing while the engine still loaded (the thread
    started with the first weight) made it 4 s longer with the default 4 GiB KV cache: its
    OpenMP team and the main thread's (the weight copies, the KV cache's zero fill)
    oversubscribed the two cores, and the zero fill took 5.2-5.5 s instead of 1.2-1.3 s (8.6 s
    to ready instead of 4.6 s). Steady-state measurements call `wait_for_prepacking()` first;
  - compiled models call the dispatcher op `vllm_cpu_linear::linear` (layers/cpu_linear.py,
    `cpu_linear_op`) for every float32 CPU linear, prepacked or not. It computes with the panel
    copy for products of `cpu_linear.panel_rows()` rows (5..64 on AVX-512, 4..64 on AMD's);
    fewer rows take the small-M kernel on the plain weight (it streams the weight faster), more
    rows oneDNN on the plain weight, and so does a weight without a current copy (never
    prepacked, or changed in place since).
`compilation_config.prepack_linear_weights` (the CPU at -O2/-O3) prepacks the decoder's linears
and the LM head (ParallelLMHead, applied eagerly through `dispatch_linear`): float32 weights,
and bfloat16 ones where the build packs bfloat16 panels (AVX2, where bfloat16 has no fast
GEMM) or where oneDNN has bfloat16 kernels (AVX512-BF16, AMX: the copy is oneDNN's reorder of
the weight, `mkldnn._reorder_linear_weight`), for products of `cpu_linear.bf16_packed_rows()`
rows. Without the C++ build there is no prepacking, and compiled models call the Python op
below instead.
"""
from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref

import torch

from vllm.logger import init_logger
from vllm.model_executor.layers.cpu_linear import (
    bf16_packed_rows,
    dispatch_linear,
    small_m_linear_available,
)
from vllm.utils.hugepages import HugePageArena, cpu_zeros, huge_pages_enabled

logger = init_logger(__name__)

def can_prepack(weight: torch.Tensor) -> bool:
    """A dense 2-D CPU weight in float32, or in bfloat16 where bfloat16 weights get a packed
    copy (`cpu_linear.bf16_packed_rows()`), with the C++ kernels built."""
    if not (weight.device.type == "cpu" and weight.dim() == 2 and weight.is_contiguous()
            and weight.dtype in (torch.float32, torch.bfloat16)
            and small_m_linear_available()):
        return False
    return weight.dtype == torch.float32 or bf16_packed_rows() != (0, 0)


def _drop(key: int) -> None:
    try:
        torch.ops.vllm_cpu_linear.drop_packed(key)
    except Exception:  # interpreter shutdown: the library may be gone already
        pass


PANEL_COLUMNS = 16  # output columns per panel (csrc/cpu_panel_linear.h, kPanel)


def panel_shape(weight: torch.Tensor) -> tuple[int, int, int]:
    """The shape of `weight`'s [N, K] panels: [ceil(N / 16), K, 16]."""
    n, k = weight.shape
    return (-(-n // PANEL_COLUMNS), k, PANEL_COLUMNS)


def prepack(weight: torch.Tensor, arena: HugePageArena | None = None) -> bool:
    """Pack `weight` [out, in] into column panels (a bfloat16 weight where the build packs no
    bfloat16 panels: oneDNN's reorder of it) and register the copy with the dispatcher; False
    when the weight is not eligible (`can_prepack`). The panels are carved from `arena` where
    one is given (the background thread's: all the model's copies in shared huge-page
    mappings), else mapped on their own (`cpu_zeros`)."""
    if not can_prepack(weight):
        return False
    version = weight._version
    with torch.no_grad():
        if weight.dtype == torch.bfloat16 and not torch.ops.vllm_cpu_linear.bf16_panels():
            # (the layout oneDNN picks for 16-row products; any row count can use it)
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 16)
        else:
            # (read each step as the weight is: in huge pages, vllm/utils/hugepages.py)
            shape = panel_shape(weight)
            packed = (arena.zeros(shape, weight.dtype) if arena is not None
                      else cpu_zeros(shape, weight.dtype))
            torch.ops.vllm_cpu_linear.pack_panels_out(weight.detach(), packed)
    if weight._version != version:  # changed in place while it was packed
        return False
    key = torch.ops.vllm_cpu_linear.set_packed(weight, packed, huge_pages_enabled())
    # The entry lives as long as the parameter: its storage (the key) cannot be reused before.
    weakref.finalize(weight, _drop, key)
    return True


class _Prepacker(threading.Thread):
    """A thread packing queued weights in queue order until it meets the end marker (None),
    then ending. Started only when no more weights come (the engine is ready).

    It must not outlive its work: a live thread that has run OpenMP regions (the packing)
    keeps its own OpenMP team, and the main thread's parallel regions then ran ~2x slower on
    the 2-core dev machine (measured: 37 -> 70 us for a small linear + relu)."""

    def __init__(self) -> None:
        super().__init__(name="vllm-prepack", daemon=True)
        self.jobs: queue.Queue[torch.Tensor | None] = queue.Queue()
        self.panel_bytes = 0
        """The bytes the queued weights' panels take (the arena's first mapping)."""
        self.done = 0
        self.finish_requested: float | None = None
        """perf_counter() when the end marker was queued (the engine reported ready)."""
        self.cancelled = False
        """Set at interpreter exit: the weights still queued are dropped."""

    def run(self) -> None:
        arena = HugePageArena(self.panel_bytes)
        while True:
            weight = self.jobs.get()
            if weight is None or self.cancelled:
                break
            try:
                self.done += prepack(weight, arena)
            except Exception:  # the weight keeps its unpacked routes
                logger.warning("prepacking a %s weight failed; it stays unpacked",
                               tuple(weight.shape), exc_info=True)
            del weight
        if self.finish_requested is not None:
            logger.info("weight prepacking: %d weights prepacked, the last %.2f s after the "
                        "engine was ready", self.done, time.perf_counter() - self.finish_requested)


_prepacker: _Prepacker | None = None
"""The thread taking new weights (while a model loads)."""
_finishing: list[_Prepacker] = []
"""Threads told to end once their queue is done (the engine did not wait for them)."""
_prepacker_lock = threading.Lock()


def prepack_in_background(weight: torch.Tensor) -> bool:
    """Queue `weight` for `prepack` on the background thread, which starts packing at
    `finish_prepacking_in_background()`; False when not eligible. Until its copy is
    registered, products with the weight take the unpacked routes (equal up to float
    rounding).
    `finish_prepacking_in_background()` or `wait_for_prepacking()` must follow (the thread
    ends then)."""
    global _prepacker
    if not can_prepack(weight):
        return False
    with _prepacker_lock:
        if _prepacker is None:
            _prepacker = _Prepacker()
        _prepacker.panel_bytes += HugePageArena.room(panel_shape(weight), weight.dtype)
        _prepacker.jobs.put(weight)
    return True


@atexit.register
def _stop_at_exit() -> None:
    """At interpreter exit, drop the weights still queued and wait for the packing in
    progress: a process that exited right after ready, with the thread inside an op, was
    aborted ("terminate called without an active exception")."""
    with _prepacker_lock:
        threads = [t for t in (_prepacker, *_finishing) if t is not None and t.is_alive()]
    for thread in threads:
        thread.cancelled = True
        thread.jobs.put(None)
    for thread in threads:
        thread.join(timeout=60)


def finish_prepacking_in_background() -> int:
    """No more weights: the thread starts, prepacks what is queued, logs when it is done, and
    ends, without anyone waiting (the engine reports ready meanwhile). The number of weights
    still queued."""
    global _prepacker
    with _prepacker_lock:
        worker, _prepacker = _prepacker, None
        if worker is None:
            return 0
        _finishing[:] = [t for t in _finishing if t.is_alive()] + [worker]
    pending = worker.jobs.qsize()
    worker.finish_requested = time.perf_counter()
    worker.jobs.put(None)
    worker.start()
    return pending


def wait_for_prepacking() -> float:
    """Block until every queued weight is prepacked and the threads have ended (for
    steady-state measurements and tests); the seconds waited."""
    finish_prepacking_in_background()
    with _prepacker_lock:
        workers, _finishing[:] = [t for t in _finishing if t.is_alive()], []
    start = time.perf_counter()
    for worker in workers:
        worker.join()
    return time.perf_counter() - start if workers else 0.0


def num_prepacked() -> int:
    return int(torch.ops.vllm_cpu_linear.num_packed()) if small_m_linear_available() else 0


@torch.library.custom_op("vllm::cpu_prepacked_linear", mutates_args=())
def cpu_prepacked_linear(x: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` through `dispatch_linear`, opaque to the compiler: what
    compiled models call when the C++ dispatcher could not be built."""
    return dispatch_linear(x, weight, bias)


@cpu_prepacked_linear.register_fake
def _cpu_prepacked_linear_fake(x: torch.Tensor, weight: torch.Tensor,
                               bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
