"""Progress an offline user sees: a tqdm bar while the weights load, and `LLM.generate`'s bar
with upstream's "est. speed input: X toks/s, output: Y toks/s" postfix."""
from __future__ import annotations

import re

import pytest
from engine_test_utils import PROMPTS

from vllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def started(llama_path):
    """An engine and what its start wrote on sys.stderr (where tqdm writes; the log handler
    keeps the stream it was made with)."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        llm = LLM(model=llama_path, optimization_level=0, max_model_len=256)
    return llm, err.getvalue()


def test_weight_loading_shows_a_tqdm_bar_of_the_tensors(started, llama_path):
    from vllm.model_executor.model_loader import count_tensors, weight_files

    _, stderr = started
    total = count_tensors(weight_files(llama_path))
    assert total > 1
    assert re.search(rf"Loading safetensors weights: 100%.*\| {total}/{total} ", stderr), \
        stderr[-2000:]


def test_generate_bar_shows_input_and_output_token_speeds(started, capsys):
    llm, _ = started
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4)
    capsys.readouterr()
    llm.generate(PROMPTS[:3], params)
    err = capsys.readouterr().err
    assert "Processed prompts: 100%" in err and "3/3" in err
    assert re.search(r"est\. speed input: \d+\.\d\d toks/s, output: \d+\.\d\d toks/s", err), err
    llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert capsys.readouterr().err == ""


class FakeBar:
    """A tqdm stand-in (`use_tqdm` may be a tqdm class) with a fixed elapsed time."""

    made: list[FakeBar] = []

    def __init__(self, total: int, **kwargs) -> None:
        self.total, self.n, self.kwargs, self.closed = total, 0, kwargs, False
        self.postfix = kwargs.get("postfix")
        self.postfixes: list[str] = []
        self.format_dict = {"elapsed": 2.0}
        FakeBar.made.append(self)

    def update(self, n: int) -> None:
        self.n += n
        self.postfixes.append(self.postfix)

    def close(self) -> None:
        self.closed = True


def test_the_speeds_count_prompt_and_generated_tokens_of_finished_requests(started):
    llm, _ = started
    FakeBar.made.clear()
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9, 10, 11, 12]}]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, min_tokens=3),
                           use_tqdm=FakeBar)
    (bar,) = FakeBar.made
    assert bar.total == 2 and bar.n == 2 and bar.closed
    assert bar.kwargs["desc"] == "Processed prompts"
    assert bar.kwargs["postfix"] == "est. speed input: 0.00 toks/s, output: 0.00 toks/s"
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 3]
    # 8 prompt and 6 generated tokens in 2 s once both have finished.
    assert bar.postfixes[-1] == "est. speed input: 4.00 toks/s, output: 3.00 toks/s"
