"""vLLM on the export gives cached.py's greedy tokens: offline (its LLM, float32 on the CPU) and served (its
OpenAI server, answered by the official openai client, streamed and not). serve.py answers a temperature-0
request with cached.py's greedy tokens, so the lesson's tokens decoded are what serve.py would say.

vLLM runs from its own venv (engines/requirements-vllm.txt; $TINY_GPT_VLLM_VENV, else .venv-vllm), each run in a
process of its own. Without that venv these tests skip, naming how to make it; in CI (CI=true) they fail.
CI runs them as a command of their own (.ci/run): vLLM's install and its starts (about a minute each on 2 cores)
are apart from the main suite's time.
"""
import os

import pytest
import torch

from bpe import BPE
from cached import load
from engines.edge.errors import BadInput
from engines.scale import vllm_peer
from helpers import free_port

TOKENS = 100


@pytest.fixture(scope="module")
def python():
    try:
        return vllm_peer.check_venv(vllm_peer.venv_path())
    except BadInput as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI needs the vLLM venv: {e}")
        pytest.skip(f"needs the vLLM venv: {e}")


@pytest.fixture(scope="module")
def lesson():
    """(bpe, prompts as ids, cached.py's TOKENS greedy tokens for each) from holmes.pt."""
    bpe, model = BPE.load("tokenizer.json"), load("holmes.pt")
    prompts = [bpe.encode(text) for text in vllm_peer.PROMPTS]
    tokens = [model.generate_cached(torch.tensor([ids]), TOKENS)[0, len(ids):].tolist() for ids in prompts]
    return bpe, prompts, tokens


@pytest.fixture(scope="module")
def folder(python, tmp_path_factory):
    """The export of holmes.pt, float32, as `python -m engines.export` writes it."""
    from engines.export.hf_folder import write_folder
    path = tmp_path_factory.mktemp("vllm") / "holmes-hf"
    write_folder(load("holmes.pt"), BPE.load("tokenizer.json"), str(path))
    return path


@pytest.fixture(scope="module")
def served(python, folder, tmp_path_factory):
    """vllm serve on the export, in a process of its own: an openai client for it."""
    import openai
    port, log = free_port(), open(tmp_path_factory.mktemp("vllm-log") / "serve.log", "w")
    process, _ = vllm_peer.start(python, folder, port, log=log)
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    vllm_peer.stop(process)
    log.close()


def test_vllm_offline_greedy_is_cached_py(python, folder, lesson):
    _, prompts, tokens = lesson
    answer, log = vllm_peer.greedy(python, folder, prompts, TOKENS)
    assert answer["tokens"] == tokens, log[-2000:]


def test_vllm_served_greedy_is_cached_py_streamed_and_not(served, lesson):
    bpe, prompts, tokens = lesson
    for ids, ours in zip(prompts, tokens):
        expected = bpe.decode(ours)
        whole = served.completions.create(model="holmes", prompt=ids, max_tokens=TOKENS, temperature=0)
        assert whole.choices[0].text == expected and whole.usage.completion_tokens == TOKENS
        stream = served.completions.create(model="holmes", prompt=ids, max_tokens=TOKENS, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == expected


def test_vllm_served_text_prompt_goes_through_the_folders_tokenizer(served, lesson):
    bpe, _, tokens = lesson
    text = vllm_peer.PROMPTS[2]  # as text: vLLM tokenizes it with the exported tokenizer, to bpe.py's ids
    answer = served.completions.create(model="holmes", prompt=text, max_tokens=TOKENS, temperature=0)
    assert answer.usage.prompt_tokens == len(bpe.encode(text))
    assert answer.choices[0].text == bpe.decode(tokens[2])
