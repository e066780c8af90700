"""Constants shared by the engine tests (a uniquely named module: every test folder has its
own conftest)."""

# Prompts of different lengths; the last two share a 2-block prefix with each other.
SHARED = ("The scheduler decides which requests run in each step under a budget of tokens "
          "and chunked prefill splits a long prompt")
PROMPTS = ["Hello world!", "The quick brown fox jumps over the lazy dog",
           SHARED + " into pieces.", SHARED + " so decodes keep running.", "A"]
MAX_TOKENS = 12



def assert_greedy_agrees(ours, ref, tol: float) -> None:
    """Two greedy RequestOutputs (logprobs >= 2) of one prompt under slightly different math
    (another KV-cache dtype): each chosen token's logprob within `tol` of the reference's, and
    the same tokens up to a near tie of the reference's top two (within `tol`), after which
    the sequences may differ (a random model's distribution is nearly flat)."""
    for a, b, mine, token in zip(ours.outputs[0].logprobs, ref.outputs[0].logprobs,
                                 ours.outputs[0].token_ids, ref.outputs[0].token_ids):
        assert abs(a[mine].logprob - b[token].logprob) <= tol, (mine, token)
        if mine != token:
            assert mine in b and abs(b[mine].logprob - b[token].logprob) <= tol, (mine, token)
            return
