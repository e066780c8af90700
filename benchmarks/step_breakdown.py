"""Where an engine step's time goes: prefill time, median decode step, and the decode step
split into linear layers, attention, sampling, other torch ops and Python/host time.

    python benchmarks/step_breakdown.py --shape llama-50m --dtype bfloat16 --batch 16

Runs our engine (at -O0 unless --level says otherwise) on a random-weight checkpoint of
benchmarks/checkpoints.py (same prompts as compare_hf.py; prefix cache reset before each run).
The split comes from one torch.profiler pass over the decode steps (self CPU time of each op,
grouped by name); the profiler's own overhead lands in the Python/host share, so read the
shares as relative. At -O1+ that share also holds Inductor's own C++ loops (norms, rotary,
activations: the compiled code calls them directly, not through torch's dispatcher, so the
profiler records no op for them).

`--phases` also times the engine's own phases of each decode step without the profiler
(wall clock around each call, `PHASES`): scheduling, input preparation, the forward, logits
and sampling, the scheduler's update and output processing (detokenizing). What lies outside
the forward and the sampling is the host work a step N+1 scheduled during step N could hide.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# (where the method lives, its name) for each phase `--phases` times: the in-process engine's
# scheduler, model runner and output processor.
PHASES = {
    "schedule": ("scheduler", "schedule"),
    "input preparation": ("runner", "_prepare_inputs"),
    "forward": ("runner", "_run_model"),
    "logits + sampling": ("runner", "_sample"),
    "scheduler update": ("scheduler", "update_from_output"),
    "output processing": ("output_processor", "process_outputs"),
}

CATEGORIES = {
    "linear": ("aten::mm", "aten::addmm", "vllm_cpu_linear", "_linear_pointwise", "aten::bmm"),
    "attention": ("attention", "write_and_attend", "index_select", "index_copy",
                  "scaled_dot_product"),
    "sampling": ("argmax", "topk", "sort", "exponential"),
}


class PhaseTimers:
    """Wall-clock time of each `PHASES` call of an in-process LLMEngine, per phase, while
    `recording` is set: wraps the bound methods on the instances (the classes are untouched)
    and restores them on `close()`."""

    def __init__(self, engine) -> None:
        owners = {"scheduler": engine.scheduler, "output_processor": engine.output_processor,
                  "runner": engine.executor.worker.model_runner}
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.recording = False
        self._restore = []
        for phase, (owner_name, method) in PHASES.items():
            owner = owners[owner_name]
            self._restore.append((owner, method))
            setattr(owner, method, self._timed(phase, getattr(owner, method)))

    def _timed(self, phase: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.recording:
                    self.seconds[phase] += time.perf_counter() - start
        return timed

    def close(self) -> None:
        for owner, method in self._restore:
            delattr(owner, method)  # the instance attribute: the class's method shows again


def phase_table(seconds: dict[str, float], wall: float, num_steps: int) -> list[str]:
    """Lines of the per-step phase split; "host work" is the step outside forward and
    sampling (schedule, input preparation, update, output processing, the loop itself)."""
    lines = []
    for phase, total in seconds.items():
        lines.append(f"  {phase:18s} {total / num_steps * 1000:8.3f} ms  "
                     f"{total / wall * 100:5.1f}%")
    rest = wall - sum(seconds.values())
    lines.append(f"  {'engine loop, rest':18s} {rest / num_steps * 1000:8.3f} ms  "
                 f"{rest / wall * 100:5.1f}%")
    host = wall - seconds["forward"] - seconds["logits + sampling"]
    lines.append(f"  host work outside forward and sampling: {host / num_steps * 1000:.3f} ms "
                 f"a step ({host / wall * 100:.1f}%)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-50m",
                        help="a shape of benchmarks/checkpoints.py, or demo (the built-in model)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ckpt-root", default=os.path.join(HERE, "results", "tmp"))
    parser.add_argument("--level", type=int, default=0, choices=range(4),
                        help="optimization level of the engine (default 0)")
    parser.add_argument("--top", type=int, default=0,
                        help="also list the N ops with the most self CPU time")
    parser.add_argument("--phases", action="store_true",
                        help="also time the engine's phases of a decode step, unprofiled")
    args = parser.parse_args()

    import torch
    from checkpoints import model_path
    from compare_hf import prompts
    from torch.profiler import ProfilerActivity, profile

    from vllm import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    path = model_path(args.shape, args.ckpt_root)
    llm = LLM(model=path, dtype=args.dtype, optimization_level=args.level, max_model_len=512,
              kv_cache_memory="2GiB", max_num_seqs=max(args.batch, 1))
    engine = llm.llm_engine
    batch_prompts = prompts(args.batch, engine.vllm_config.model_config.get_vocab_size())
    counter = [0]

    def prefill() -> float:
        engine.reset_prefix_cache()
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        for i, p in enumerate(batch_prompts):
            engine.add_request(f"r{counter[0]}_{i}", {"prompt_token_ids": p}, params)
        counter[0] += 1
        start = time.perf_counter()
        engine.step()
        return time.perf_counter() - start

    def decode() -> list[float]:
        times = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        return times

    prefill()
    decode()
    best_prefill = best_step = float("inf")
    for _ in range(args.repeats):
        best_prefill = min(best_prefill, prefill())
        steps = sorted(decode())
        best_step = min(best_step, steps[len(steps) // 2])
    if args.phases:
        timers = PhaseTimers(engine)
        prefill()
        timers.recording = True
        start = time.perf_counter()
        num_steps = len(decode())
        wall = time.perf_counter() - start
        timers.recording = False
        timers.close()
        print(f"decode step {wall / num_steps * 1000:.2f} ms (mean of {num_steps}, "
              f"unprofiled), by engine phase:")
        print("\n".join(phase_table(timers.seconds, wall, num_steps)))
    prefill()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        num_steps = len(decode())
        wall = time.perf_counter() - start
    shares = dict.fromkeys([*CATEGORIES, "other torch ops"], 0.0)
    for event in prof.key_averages():
        seconds = event.self_cpu_time_total / 1e6
        category = next((c for c, keys in CATEGORIES.items()
                         if any(k in event.key for k in keys)), "other torch ops")
        shares[category] += seconds
    shares["python/host"] = wall - sum(shares.values())
    print(f"{args.shape} {args.dtype} -O{args.level} batch {args.batch}, {args.threads} thread(s): "
          f"prefill "
          f"{best_prefill * 1000:.0f} ms, decode step {best_step * 1000:.2f} ms (median, best of "
          f"{args.repeats}); profiled decode step {wall / num_steps * 1000:.2f} ms:")
    for category, seconds in shares.items():
        per_step = seconds / num_steps * 1000
        print(f"  {category:16s} {per_step:8.2f} ms  {seconds / wall * 100:5.1f}%")
    if args.top:
        print(f"top {args.top} ops by self CPU time per decode step:")
        events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        for event in events[:args.top]:
            print(f"  {event.self_cpu_time_total / num_steps / 1000:8.3f} ms  "
                  f"{event.count / num_steps:6.1f} calls  {event.key}")


if __name__ == "__main__":
    main()
