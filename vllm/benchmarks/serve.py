"""Load-test a running OpenAI-compatible server: throughput, TTFT, TPOT, ITL and latency.

Sends `--num-prompts` streaming requests of random prompts (`--random-input-len`,
`--random-output-len`, spread by `--random-range-ratio`) at `--request-rate` per second
(Poisson, or gamma with `--burstiness`) and/or at most `--max-concurrency` at once, and reports
request and token throughput with mean/median/percentile TTFT (time to first token), TPOT
(time per output token after the first), ITL (time between streamed chunks) and E2EL (request
latency). With a tokenizer (`--tokenizer`, or the served model's folder) prompts are token ids
of the exact length; otherwise random words. Use `--ignore-eos` for exact output lengths.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

_WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly "
          "judge every box of mixed liquor and time flies like an arrow").split()


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of `vllm bench serve` (upstream's spellings)."""
    parser.add_argument("--backend", default="vllm", choices=["vllm", "openai", "openai-chat"],
                        help="vllm/openai: /v1/completions; openai-chat: /v1/chat/completions.")
    parser.add_argument("--base-url", default=None,
                        help="Server URL (e.g. http://127.0.0.1:8000); overrides --host/--port.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default=None,
                        help="API path (default: by --backend).")
    parser.add_argument("--model", default=None,
                        help="Model name to request (default: the first of /v1/models).")
    parser.add_argument("--tokenizer", default=None,
                        help="Tokenizer folder for exact-length prompts (default: the served "
                        "model's folder when it exists here).")
    parser.add_argument("--dataset-name", default="random", choices=["random"])
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="Lengths are drawn uniformly from [len*(1-r), len*(1+r)].")
    parser.add_argument("--random-prefix-len", type=int, default=0,
                        help="A shared prefix of this many tokens in front of every prompt.")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="Requests per second (default: inf, all at once).")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="Gamma shape of the arrival gaps (1: Poisson).")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="At most this many requests in flight.")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="Generate exactly the requested output lengths (also sent as "
                        "min_tokens, for servers without ignore_eos such as llama.cpp's). "
                        "Output tokens are the server's usage counts, else its streamed chunks.")
    parser.add_argument("--extra-body", default=None,
                        help="A JSON object merged into every request body, e.g. "
                        "'{\"repeat_penalty\": 1.0}'.")
    parser.add_argument("--text-prompts", action="store_true",
                        help="Send prompts as text even when a tokenizer gives token ids (for "
                        "servers that take only text).")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                        help="Comma-separated metrics to report percentiles for.")
    parser.add_argument("--metric-percentiles", default="99",
                        help="Comma-separated percentiles besides mean and median, e.g. 90,99.")
    parser.add_argument("--api-key", default=None,
                        help="Bearer token (default: OPENAI_API_KEY or VLLM_API_KEY).")
    parser.add_argument("--output-json", default=None, help="Write the results here as JSON.")
    parser.add_argument("--label", default=None, help="A label stored with the results.")
    return parser


@dataclass
class RequestSpec:
    prompt: str | list[int]
    input_len: int
    output_len: int


@dataclass
class RequestResult:
    success: bool = False
    input_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    chunks: int = 0  # token arrivals: the output length when the server sends no usage
    usage_seen: bool = False


# ---- workload ----------------------------------------------------------------------------
def _lengths(rng: random.Random, mean: int, ratio: float, count: int) -> list[int]:
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(low, high) for _ in range(count)]


def load_tokenizer(path: str | None) -> Any:
    if not path or not os.path.isdir(os.path.expanduser(path)):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(os.path.expanduser(path))
    except Exception as exc:  # noqa: BLE001 - fall back to word prompts
        print(f"could not load tokenizer {path!r} ({exc}); using word prompts", file=sys.stderr)
        return None


def sample_random_requests(args: argparse.Namespace, tokenizer: Any,
                           as_text: bool) -> list[RequestSpec]:
    """Random prompts with the requested length distribution (token ids when a tokenizer is
    known and the endpoint takes them, else text)."""
    rng = random.Random(args.seed)
    n = args.num_prompts
    in_lens = _lengths(rng, args.random_input_len, args.random_range_ratio, n)
    out_lens = _lengths(rng, args.random_output_len, args.random_range_ratio, n)
    specs = []
    if tokenizer is not None:
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        vocab = [t for t in range(len(tokenizer)) if t not in special]
        prefix = [rng.choice(vocab) for _ in range(args.random_prefix_len)]
        for i in range(n):
            ids = prefix + [rng.choice(vocab) for _ in range(in_lens[i])]
            prompt: str | list[int] = tokenizer.decode(ids) if as_text else ids
            specs.append(RequestSpec(prompt, len(ids), out_lens[i]))
        return specs
    prefix_words = [rng.choice(_WORDS) for _ in range(args.random_prefix_len)]
    for i in range(n):
        words = prefix_words + [rng.choice(_WORDS) for _ in range(in_lens[i])]
        specs.append(RequestSpec(" ".join(words), len(words), out_lens[i]))
    return specs


async def _arrivals(specs: list[RequestSpec], rate: float, burstiness: float, seed: int):
    rng = random.Random(seed + 1)
    for i, spec in enumerate(specs):
        yield spec
        if rate == float("inf") or i == len(specs) - 1:
            continue
        gap = rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        await asyncio.sleep(gap)


# ---- one request -------------------------------------------------------------------------
async def send_request(client: Any, url: str, payload: dict, headers: dict,
                       spec: RequestSpec, chat: bool) -> RequestResult:
    result = RequestResult(input_len=spec.input_len)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = json.dumps(chunk["error"])
                    return result
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") if chat \
                        else choice.get("text")
                    # A token arrived: text, or a chunk before the end whose token decodes to
                    # nothing yet (random weights, partial characters). A last chunk that
                    # only carries the finish reason is not a token.
                    if piece or (piece is not None and choice.get("finish_reason") is None):
                        result.chunks += 1
                        now = time.perf_counter()
                        if result.ttft == 0.0:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
                usage = chunk.get("usage")
                if usage:
                    result.output_len = int(usage.get("completion_tokens") or 0)
                    result.usage_seen = True
        result.latency = time.perf_counter() - start
        result.success = True
    except Exception as exc:  # noqa: BLE001 - reported per request
        result.error = f"{type(exc).__name__}: {exc}"
    return result


# ---- the run -----------------------------------------------------------------------------
def _percentiles(values: list[float], pcts: list[float]) -> dict[str, float]:
    if not values:
        return {f"p{_pct_name(p)}": 0.0 for p in pcts}
    ordered = sorted(values)
    out = {}
    for p in pcts:
        k = (len(ordered) - 1) * p / 100.0
        lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
        out[f"p{_pct_name(p)}"] = ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)
    return out


def _pct_name(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def summarize(results: list[RequestResult], duration: float, metrics: list[str],
              pcts: list[float]) -> dict[str, Any]:
    """Throughput and latency statistics (times in milliseconds)."""
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.input_len for r in ok)
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    summary: dict[str, Any] = {
        "duration_s": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        "errors": sorted({r.error for r in results if r.error})[:5],
    }
    for name in metrics:
        values = [v * 1000.0 for v in series[name]]
        summary[f"mean_{name}_ms"] = statistics.fmean(values) if values else 0.0
        summary[f"median_{name}_ms"] = statistics.median(values) if values else 0.0
        summary[f"std_{name}_ms"] = statistics.pstdev(values) if values else 0.0
        for key, value in _percentiles(values, pcts).items():
            summary[f"{key}_{name}_ms"] = value
    return summary


def _extra_body(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--extra-body must be a JSON object, got {text!r} ({exc})") from None
    if not isinstance(body, dict):
        raise ValueError(f"--extra-body must be a JSON object, got {text!r}")
    return body


async def _resolve_model(client: Any, base: str, headers: dict) -> tuple[str, str | None]:
    resp = await client.get(f"{base}/v1/models", headers=headers)
    resp.raise_for_status()
    card = resp.json()["data"][0]
    return card["id"], card.get("root")


async def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the load and return the summary (also the JSON written by --output-json)."""
    import httpx

    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    chat = args.backend == "openai-chat"
    endpoint = args.endpoint or ("/v1/chat/completions" if chat else "/v1/completions")
    key = args.api_key or os.environ.get("OPENAI_API_KEY") or os.environ.get("VLLM_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = [m for m in metrics if m not in ("ttft", "tpot", "itl", "e2el")]
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {unknown}; use ttft,tpot,itl,e2el")
    pcts = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        try:
            model, root = await _resolve_model(client, base, headers)
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"cannot query {base}/v1/models: {exc!r}") from None
        model = args.model or model
        tokenizer = load_tokenizer(args.tokenizer or root)
        specs = sample_random_requests(args, tokenizer,
                                       as_text=chat or getattr(args, "text_prompts", False))
        extra = _extra_body(getattr(args, "extra_body", None))
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        def payload(spec: RequestSpec) -> dict:
            body: dict[str, Any] = {
                "model": model, "max_tokens": spec.output_len, "temperature": args.temperature,
                "stream": True, "stream_options": {"include_usage": True},
                "ignore_eos": args.ignore_eos}
            if args.ignore_eos:
                body["min_tokens"] = spec.output_len
            body.update(extra)
            if chat:
                body["messages"] = [{"role": "user", "content": spec.prompt}]
            else:
                body["prompt"] = spec.prompt
            return body

        async def one(spec: RequestSpec) -> RequestResult:
            if sem is None:
                return await send_request(client, base + endpoint, payload(spec), headers,
                                          spec, chat)
            async with sem:
                return await send_request(client, base + endpoint, payload(spec), headers,
                                          spec, chat)

        start = time.perf_counter()
        tasks = []
        async for spec in _arrivals(specs, args.request_rate, args.burstiness, args.seed):
            tasks.append(asyncio.create_task(one(spec)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    for r in results:  # servers that send no usage (llama.cpp's): one chunk per token
        if r.success and not r.usage_seen:
            r.output_len = r.chunks
    summary = summarize(results, duration, metrics, pcts)
    summary.update(
        label=args.label, base_url=base, endpoint=endpoint, model=model,
        num_prompts=args.num_prompts, request_rate=args.request_rate,
        max_concurrency=args.max_concurrency, random_input_len=args.random_input_len,
        random_output_len=args.random_output_len, random_range_ratio=args.random_range_ratio,
        exact_prompt_lengths=tokenizer is not None and not chat,
        date=time.strftime("%Y-%m-%d %H:%M:%S"))
    return summary


def format_summary(s: dict[str, Any], metrics: list[str]) -> str:
    rows = [("Successful requests", s["completed"]), ("Failed requests", s["failed"]),
            ("Benchmark duration (s)", f"{s['duration_s']:.2f}"),
            ("Total input tokens", s["total_input_tokens"]),
            ("Total generated tokens", s["total_output_tokens"]),
            ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{s['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{s['total_token_throughput']:.2f}")]
    for name in metrics:
        keys = [f"mean_{name}_ms", f"median_{name}_ms"] + sorted(
            (k for k in s if k.startswith("p") and k.endswith(f"_{name}_ms")),
            key=lambda k: float(k[1:].split("_")[0]))
        for key in keys:
            stat = key.split("_", 1)[0]
            rows.append((f"{stat.capitalize()} {name.upper()} (ms)", f"{s[key]:.2f}"))
    width = max(len(r[0]) for r in rows) + 2
    lines = ["=" * 20 + " Serving Benchmark Result " + "=" * 20]
    lines += [f"{k + ':':<{width}}{v}" for k, v in rows]
    if s.get("errors"):
        lines.append("errors: " + "; ".join(s["errors"]))
    lines.append("=" * 66)
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """`vllm bench serve`: print the summary; write it to --output-json; exit 1 if any
    request failed."""
    summary = asyncio.run(run_benchmark(args))
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    print(format_summary(summary, metrics))
    if args.output_json:
        folder = os.path.dirname(os.path.abspath(args.output_json))
        os.makedirs(folder, exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=2)
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    _parser = add_cli_args(argparse.ArgumentParser(description=__doc__))
    sys.exit(main(_parser.parse_args()))


__all__ = ["add_cli_args", "main", "run_benchmark", "summarize", "RequestResult",
           "RequestSpec"]
