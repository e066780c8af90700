"""The OpenAI-compatible server (`vllm serve`): api_server (app and life cycle), protocol
(request models, error shape), cli_args (the server's flags), serving_engine (what the
handlers share), serving_completion / serving_chat / serving_responses (the handlers), metrics."""
