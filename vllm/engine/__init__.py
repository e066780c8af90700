"""The engine core: scheduler, KV cache manager, model runner, LLMEngine."""
