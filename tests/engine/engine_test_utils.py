"""Constants shared by the engine tests (a uniquely named module: every test folder has its
own conftest)."""

# Prompts of different lengths; the last two share a 2-block prefix with each other.
SHARED = ("The scheduler decides which requests run in each step under a budget of tokens "
          "and chunked prefill splits a long prompt")
PROMPTS = ["Hello world!", "The quick brown fox jumps over the lazy dog",
           SHARED + " into pieces.", SHARED + " so decodes keep running.", "A"]
MAX_TOKENS = 12

