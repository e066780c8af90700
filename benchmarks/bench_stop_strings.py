"""Per-step cost of stop-string matching and bad-words checks: one stop string (or word)
against the maximum SamplingParams allows, what the engine does now (the automaton; str.find
for a few stop strings; the bad-words index) against the old search (one `str.find` per stop
string per step; one comparison per word per step).

A step is one sequence's stop check after a decode step adds `--chars` characters (~one
token) to a text `--text-len` characters long; the stop strings never match, so every step
does the full check. Times are per step and per sequence: a request with n sequences pays
n times that each step. Also reported: the one-off cost of building the automaton.

    python benchmarks/bench_stop_strings.py            # writes benchmarks/results/stop_strings.*
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from vllm.engine.stop_matcher import (  # noqa: E402
    StopStringMatcher,
    find_stop_string_brute_force,
)
from vllm.sampling_params import (  # noqa: E402
    MAX_BAD_WORDS,
    MAX_STOP_STRINGS,
    MAX_STOP_STRINGS_TOTAL_LENGTH,
    SamplingParams,
)


def stop_sets(rng: random.Random) -> dict[str, list[str]]:
    length = MAX_STOP_STRINGS_TOTAL_LENGTH // MAX_STOP_STRINGS
    return {
        "1 stop string": ["\n\nUser:"],
        f"{MAX_STOP_STRINGS} random stop strings of {length} chars": [
            "".join(rng.choice("abcdefgh ") for _ in range(length))
            for _ in range(MAX_STOP_STRINGS)],
        f"{MAX_STOP_STRINGS} stop strings sharing a {length - 1}-char prefix (adversarial)": [
            "a" * (length - 1) + chr(0x100 + i) for i in range(MAX_STOP_STRINGS)],
    }


def per_step(fn, steps: int, repeats: int) -> float:
    """The fastest of `repeats` runs, in mean seconds per step (the least disturbed by other
    load on the machine)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(steps)
        times.append((time.perf_counter() - start) / steps)
    return min(times)


def bench_stops(text_len: int, chars: int, steps: int, repeats: int) -> list[dict]:
    rng = random.Random(0)
    rows = []
    for name, stops in stop_sets(rng).items():
        # Output text the stops never match: "a"s (worst case for the shared-prefix set),
        # one string per step, made beforehand (slicing would add the same to both sides).
        texts = ["a" * (text_len + (step + 1) * chars) for step in range(steps)]
        builds = []
        for _ in range(repeats):
            start = time.perf_counter()
            matcher = StopStringMatcher(stops)
            builds.append(time.perf_counter() - start)
        build_s = min(builds)

        def engine(n: int, matcher=matcher, texts=texts) -> None:
            cursor = matcher.cursor()
            for step in range(n):
                cursor.find(texts[step], chars)

        def brute(n: int, stops=stops, texts=texts) -> None:
            for step in range(n):
                find_stop_string_brute_force(texts[step], chars, stops)

        old = per_step(brute, steps, repeats)
        new = per_step(engine, steps, repeats)
        rows.append({"case": name, "stop_strings": len(stops),
                     "mode": "automaton" if matcher.automaton else "str.find",
                     "automaton_states": matcher.num_states, "build_ms": build_s * 1e3,
                     "old_us_per_step": old * 1e6, "engine_us_per_step": new * 1e6,
                     "speedup": old / new})
    return rows


def bench_bad_words(output_len: int, steps: int, repeats: int) -> list[dict]:
    class CharTokenizer:
        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    rows = []
    for count in (1, MAX_BAD_WORDS):
        params = SamplingParams(bad_words=[f"w{i:04d}" for i in range(count)])
        params.update_from_tokenizer(CharTokenizer())
        sequences = params._bad_words_token_ids
        output = [ord("w")] * output_len

        def old(n: int, output=output, sequences=sequences) -> None:
            for _ in range(n):
                tail = output[:]  # the runner sliced the output off the sequence each step
                for seq in sequences:
                    prefix = seq[:-1]
                    _ = not prefix or tail[-len(prefix):] == prefix

        def new(n: int, params=params, output=output) -> None:
            for _ in range(n):
                params.banned_by_bad_words(output, 0)

        t_old = per_step(old, steps, repeats)
        t_new = per_step(new, steps, repeats)
        rows.append({"case": f"{count} bad words", "sequences": len(sequences),
                     "old_us_per_step": t_old * 1e6, "index_us_per_step": t_new * 1e6,
                     "speedup": t_old / t_new})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text-len", type=int, default=2000)
    parser.add_argument("--chars", type=int, default=4, help="new characters per step")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "stop_strings"))
    args = parser.parse_args()
    stops = bench_stops(args.text_len, args.chars, args.steps, args.repeats)
    words = bench_bad_words(args.text_len // 4, args.steps, args.repeats)
    load = os.getloadavg()[0]
    result = {"args": vars(args), "cpus": os.cpu_count(), "load_avg_1min": load,
              "stop_strings": stops, "bad_words": words}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=2)
    lines = ["# Stop strings and bad words: per-step cost per sequence", "",
             f"Text of {args.text_len} characters, {args.chars} new per step; fastest of "
             f"{args.repeats} runs (`python benchmarks/bench_stop_strings.py`); "
             f"{os.cpu_count()} CPUs, load average {load:.1f} while measuring. A request "
             "with n=128 pays 128 times the per-step cost every step.", "",
             "| case | search | build (ms) | old (us/step) | now (us/step) | speedup | "
             "n=128: old / now (ms/step) |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['mode']} | {r['build_ms']:.1f} | "
              f"{r['old_us_per_step']:.1f} | {r['engine_us_per_step']:.2f} | "
              f"{r['speedup']:.1f}x | {r['old_us_per_step'] * 0.128:.1f} / "
              f"{r['engine_us_per_step'] * 0.128:.2f} |" for r in stops]
    lines += ["", "| case | old (us/step) | index (us/step) | speedup |", "|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['old_us_per_step']:.1f} | {r['index_us_per_step']:.2f} | "
              f"{r['speedup']:.1f}x |" for r in words]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
