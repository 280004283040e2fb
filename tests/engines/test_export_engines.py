"""The engines themselves run the export: llama.cpp (library and OpenAI-compatible server) and CTranslate2.

Outside CI an engine that is not installed skips its tests, naming engines/requirements.txt;
in CI (CI=true) it fails them.
"""
import json
import subprocess
import sys
import time
import urllib.request

import gguf
import llama_cpp
import pytest
import torch
from children import ct2_greedy_as_it_loads, segfault
from helpers import ODD_TEXTS, free_port, run_main_once
from support import command

from engines.export import export
from engines.export import peers
from bpe import BPE
from engines.edge.cli import run_cli
from cached import first_difference
from engines.export.export import PROMPT, cached_tokens, neox_state_dict, spelled_vocabulary


@pytest.fixture(scope="module")
def holmes(shipped):
    model, bpe = shipped, BPE.load("tokenizer.json")
    return model, bpe, cached_tokens(model, bpe.encode(PROMPT), 100)


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """One export.py run writing both engines' outputs, as a reader runs it (in this process): (stdout, folder)."""
    out = tmp_path_factory.mktemp("engines")
    status, stdout, err = run_main_once(command(export.main), ["export.py", "--gguf", out / "holmes.gguf",
                                                      "--ct2", out / "holmes-ct2"])
    assert status == 0, err
    return stdout, out


@pytest.fixture(scope="module")
def llama_tokenized(cli_run):
    """(ids, decoded text) of each odd text through the GGUF's own tokenizer."""
    return dict(zip(ODD_TEXTS, peers.isolated("llama.cpp", peers.llama_tokenize, cli_run[1] / "holmes.gguf", ODD_TEXTS)))


def llama_greedy(path, prompt, batch, n_tokens):
    rows, _ = peers.isolated("llama.cpp", peers.llama_greedy, path, prompt, batch, n_tokens, torch.get_num_threads())
    return rows


@pytest.fixture(scope="module", params=["f16", "q8_0"])
def smaller_gguf(request, holmes, tmp_path_factory):
    model, bpe, _ = holmes
    path = tmp_path_factory.mktemp("gguf") / f"holmes-{request.param}.gguf"
    peers.write_gguf(path, model.cfg, neox_state_dict(model), *spelled_vocabulary(bpe), request.param)
    return request.param, path


def test_the_cli_reports_each_engine_equal_to_cached_py_and_leaves_only_its_outputs(cli_run):
    stdout, out = cli_run
    assert "llama.cpp: tokenizer ids equal bpe.py's" in stdout
    assert "llama.cpp: 100 greedy tokens from 'The night was': the same tokens as cached.py" in stdout
    assert "CTranslate2, float32: 100 greedy tokens from 'The night was': the same tokens as cached.py" in stdout
    assert sorted(p.name for p in out.iterdir()) == ["holmes-ct2", "holmes.gguf"]  # no temporary folder left
    assert "wrote holmes-hf" not in stdout  # no OUT_DIR given: only what was asked for


def test_the_gguf_says_gptneox_gpt2_bpe_and_an_honest_stop(cli_run):
    reader = gguf.GGUFReader(cli_run[1] / "holmes.gguf")

    def value(key):
        return reader.fields[key].contents()
    assert value("general.architecture") == "gptneox"
    assert (value("tokenizer.ggml.model"), value("tokenizer.ggml.pre")) == ("gpt2", "gpt-2")
    assert value("gptneox.rope.dimension_count") == 64 and value("gptneox.use_parallel_residual") is False
    assert value("tokenizer.ggml.add_bos_token") is False
    stop = value("tokenizer.ggml.eos_token_id")
    assert stop == value("tokenizer.ggml.bos_token_id") == peers.STOP_ID
    bpe = BPE.load("tokenizer.json")
    assert bpe.vocab[stop] == b"\xff" and all(stop not in bpe.encode(text) for text in ODD_TEXTS)


@pytest.mark.parametrize("text", ODD_TEXTS)
def test_llama_cpps_tokenizer_gives_bpe_pys_ids_and_prepends_nothing(llama_tokenized, holmes, text):
    ids, decoded = llama_tokenized[text]
    assert ids == holmes[1].encode(text)
    assert decoded == text


def test_llama_cpp_f32_greedy_is_cached_pys_for_100_tokens(cli_run, holmes):
    assert llama_greedy(cli_run[1] / "holmes.gguf", holmes[1].encode(PROMPT), 1, 100) == [holmes[2]]


def test_llama_cpp_f16_is_exact_and_q8_0_reports_where_it_parts(smaller_gguf, holmes):
    kind, path = smaller_gguf
    [theirs] = llama_greedy(path, holmes[1].encode(PROMPT), 1, 100)
    parted = first_difference(theirs, holmes[2])
    if kind == "f16":
        assert parted is None
    else:  # quantized: no bound, only a report
        print(f"llama.cpp q8_0 parts from cached.py after {'no' if parted is None else parted} of 100 tokens")
        assert len(theirs) == 100


def test_llama_cpps_batched_decoding_gives_every_row_cached_pys_tokens(cli_run, holmes):
    rows = llama_greedy(cli_run[1] / "holmes.gguf", holmes[1].encode(PROMPT), 3, 30)
    assert rows == [holmes[2][:30]] * 3


def post(url, body):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as response:
        return json.load(response)


def test_llama_cpps_openai_server_completes_the_prompt_with_cached_pys_text(cli_run, holmes):
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", cli_run[1] / "holmes.gguf",
                               "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "512"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:  # until it answers, or exits
            assert server.poll() is None, "the server exited"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).close()
                break
            except OSError:
                time.sleep(0.5)
        # temperature 0 is greedy; the server's default repeat_penalty (1.1) would still reorder the scores
        answer = post(f"http://127.0.0.1:{port}/v1/completions",
                      {"prompt": PROMPT, "max_tokens": 100, "temperature": 0, "repeat_penalty": 1.0})
        assert answer["choices"][0]["text"] == holmes[1].decode(holmes[2])
        assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 100, "total_tokens": 103}
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def test_ctranslate2_float32_greedy_is_cached_pys_for_100_tokens(cli_run, holmes):
    path = cli_run[1] / "holmes-ct2"
    vocabulary = json.loads((path / "vocabulary.json").read_text())
    start = [vocabulary[i] for i in holmes[1].encode(PROMPT)]
    assert peers.isolated("CTranslate2", ct2_greedy_as_it_loads, path, start) == holmes[2]


def test_llama_cpp_loads_without_repacking_where_it_uses_amx(monkeypatch):
    for info, repacks in ((b"AVX2 = 1 | AMX_INT8 = 1 | ", False), (b"AVX2 = 1 | AMX_INT8 = 0 | ", True)):
        monkeypatch.setattr(llama_cpp, "llama_print_system_info", lambda info=info: info)
        assert peers.llama_model_params(llama_cpp).use_extra_bufts is repacks


def test_a_crashing_engine_ends_export_py_in_one_line_and_leaves_nothing(holmes, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(peers, "llama_greedy", segfault)
    monkeypatch.setattr(sys, "argv", ["export.py", "--gguf", str(tmp_path / "x.gguf")])
    with pytest.raises(SystemExit) as exit:
        run_cli(export.main)
    assert exit.value.code == "export.py: error: llama.cpp crashed (signal SIGSEGV) in a process of its own; " \
                              "nothing written"
    assert list(tmp_path.iterdir()) == []
