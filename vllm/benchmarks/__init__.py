"""The `vllm bench` benchmarks. Each module exposes `add_cli_args(parser)` and `main(args)`
and is listed in `vllm/entrypoints/cli/bench.py`."""
