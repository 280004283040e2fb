"""Hand the trained model to the engines people serve with: a Hugging Face folder, a GGUF, a CTranslate2 model.

The model as GPT-NeoX, the architecture with Part 3's shape, with its RoPE
layout turned from interleaved pairs to halves (engines/export/hf_folder.py says
why, and the trap one level up in config.json); this file is the command.

    python -m engines.export [CHECKPOINT] [OUT_DIR] --tokenizer tokenizer.json [--force]

writes OUT_DIR (default holmes-hf/) with config.json, model.safetensors and a
fast tokenizer, then loads it back through transformers and checks logits,
token ids and greedy generation against this repo; it exits 1 if any differ.

    python -m engines.export --gguf holmes.gguf [--gguf-type f32|f16|q8_0]
    python -m engines.export --ct2 holmes-ct2

write a GGUF for llama.cpp (with the gguf package, llama.cpp's own writer) and
a CTranslate2 model (through ctranslate2's converter classes) from the same
proven folder, then run each engine greedily and report where it parts from
cached.py (engines/export/peers.py; pip install -r engines/requirements.txt). OUT_DIR is
written too when given. --force replaces a previous export only.

    python -m engines.export --break layout     # without the RoPE permutation
    python -m engines.export --break rotary     # as transformers 4 reads a folder without rotary_pct

build the broken folder in a temporary directory, report how far the logits
move and where greedy text parts, and keep nothing.
"""
import importlib.util

from engines.edge.cli import run_cli
from engines.edge.errors import BadValue


def main():
    if importlib.util.find_spec("transformers") is None:  # the whole export reads and writes through it
        raise BadValue("python -m engines.export needs transformers; pip install -r engines/requirements.txt")
    from engines.export.export import main as export
    export()


if __name__ == "__main__":
    run_cli(main)
