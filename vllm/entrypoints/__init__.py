"""User-facing entry points: the `LLM` class, the servers and the `vllm` command line."""
