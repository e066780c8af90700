"""The OpenAI-compatible server (`vllm serve`): api_server (app and life cycle), protocol
(request models, error shape), serving_completion / serving_chat (the handlers), metrics."""
