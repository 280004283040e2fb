"""export.py: the Hugging Face folder computes what model.py computes, and speaks bpe.py's ids; nothing is lost."""
import errno
import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from helpers import ODD_TEXTS, PART3_CONFIG, one_line_exit, part3_state_dict, run_main
from support import command, save_checkpoint

from engines.export import export
from bpe import BPE
from cached import CachedGPT
from engines.edge.checkpoint import load_cached as load
from engines.export.hf_folder import load_folder, rope_layout, write_folder
from engines.edge.cli import run_cli
from model import Config

def small_bpe(vocab_size):
    """A tokenizer of exactly vocab_size tokens, trained on text like the corpus."""
    return BPE.train(" ".join(ODD_TEXTS) * 20, vocab_size)


def exported(tmp_path_factory, model, bpe, name):
    path = tmp_path_factory.mktemp(name)
    write_folder(model, bpe, path)
    return load_folder(path)


@pytest.fixture(scope="module")
def exported_holmes(tmp_path_factory, shipped):
    bpe = BPE.load("tokenizer.json")
    return shipped, bpe, *exported(tmp_path_factory, shipped, bpe, "holmes-hf")


@pytest.fixture(scope="module", params=["part3", "gqa"])
def small(request, tmp_path_factory):
    """A Part 3 checkpoint written by independent test code, and a GQA one written by this repo."""
    path = tmp_path_factory.mktemp("ckpt") / "model.pt"
    if request.param == "part3":
        cfg = dict(PART3_CONFIG, vocab_size=300, d_model=64, n_layers=2)
        torch.save({"model": part3_state_dict(cfg), "config": cfg, "step": 0}, path)
    else:
        torch.manual_seed(0)
        save_checkpoint(CachedGPT(Config(vocab_size=300, d_model=64, n_heads=4, n_kv_heads=2, n_layers=2)), path, 0)
    model, bpe = load(path), small_bpe(300)
    return model, bpe, *exported(tmp_path_factory, model, bpe, request.param)


def logits_difference(model, hf):
    idx = torch.randint(model.cfg.vocab_size, (2, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return (hf(idx).logits - model(idx)[0]).abs().max().item()


def test_the_shipped_checkpoints_logits_agree_within_1e_4(exported_holmes):
    model, _, hf, _ = exported_holmes
    assert logits_difference(model, hf) < 1e-4


def test_part3_and_gqa_checkpoints_logits_agree_within_1e_4(small):
    model, _, hf, _ = small
    assert logits_difference(model, hf) < 1e-4


def test_transformers_greedy_generate_is_cached_pys_for_100_tokens(exported_holmes):
    model, bpe, hf, _ = exported_holmes
    prompt = torch.tensor([bpe.encode("It was a dark night, and Holmes")])
    with torch.no_grad():
        theirs = hf.generate(prompt, max_new_tokens=100, min_new_tokens=100, do_sample=False, pad_token_id=0)
    assert torch.equal(theirs, model.generate_cached(prompt, 100))


@pytest.mark.parametrize("text", ODD_TEXTS)
def test_the_fast_tokenizer_gives_bpe_pys_ids_and_decodes_back(exported_holmes, text):
    _, bpe, _, tokenizer = exported_holmes
    ids = tokenizer(text)["input_ids"]
    assert ids == bpe.encode(text)
    assert tokenizer.decode(ids) == text


def test_a_small_tokenizer_agrees_too(small):
    _, bpe, _, tokenizer = small
    for text in ODD_TEXTS:
        assert tokenizer(text)["input_ids"] == bpe.encode(text)


def test_the_rope_layout_puts_evens_first_then_odds():
    assert rope_layout(8).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


@pytest.fixture
def run_export(monkeypatch, capsys):
    """export.py run in this process: (exit status, stdout, stderr)."""
    return lambda *args: run_main(command(export.main), ["export.py", *args], monkeypatch, capsys)


def test_cli_writes_a_folder_transformers_loads_and_reports_each_check(tmp_path, run_export):
    out = tmp_path / "holmes-hf"
    status, stdout, err = run_export("holmes.pt", out)
    assert status == 0, err
    assert "largest difference from model.py" in stdout and "the same tokens as cached.py" in stdout
    assert "ids equal bpe.py's" in stdout
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "gpt_neox"
    assert AutoTokenizer.from_pretrained(out)("Holmes")["input_ids"] == BPE.load("tokenizer.json").encode("Holmes")


def test_a_narrower_folder_stores_that_dtype_and_is_the_rounded_checkpoint(tmp_path, run_export):
    """vLLM's fast attention takes no float32: --dtype writes the weights narrower, proven (logits within 1e-4,
    cached.py's tokens, every weight bit for bit) against model.py with its weights rounded alike (float16 takes
    the same path)."""
    out, dtype = tmp_path / "hf", "bfloat16"
    status, stdout, err = run_export("holmes.pt", out, "--dtype", dtype)
    assert status == 0, err
    assert f"its weights {dtype}" in stdout and "the same tokens as cached.py" in stdout
    stored = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert {p.dtype for p in stored.parameters()} == {getattr(torch, dtype)}
    status, stdout, err = run_export("--check", out)
    assert status == 0, err
    assert f"({dtype})" in stdout and "exactly the export's" in stdout


def test_dtype_is_the_folders_alone(tmp_path, monkeypatch):
    message = one_line_exit(command(export.main), monkeypatch, "export.py", "holmes.pt", "--gguf", tmp_path / "m.gguf",
                            "--dtype", "bfloat16")
    assert "--dtype is the Hugging Face folder's" in message and not (tmp_path / "m.gguf").exists()


def test_break_layout_really_moves_the_logits_and_keeps_nothing(tmp_path, run_export):
    status, stdout, err = run_export("holmes.pt", tmp_path / "out", "--break", "layout")
    assert status == 0, err
    moved = float(stdout.split("largest difference from model.py ")[1].split()[0])
    assert moved > 1.0 and "parts from cached.py after" in stdout
    assert not (tmp_path / "out").exists()


def test_config_json_carries_what_transformers_4_reads(exported_holmes, tmp_path):
    model, bpe, _, _ = exported_holmes
    write_folder(model, bpe, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    # without rotary_pct transformers 4 rotates a quarter of each head; it does not know TokenizersBackend
    assert config["rotary_pct"] == 1.0 and config["rotary_emb_base"] == 10000
    assert config["rope_parameters"]["partial_rotary_factor"] == 1.0
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_break_rotary_shows_what_transformers_4_makes_of_a_folder_without_rotary_pct(tmp_path, run_export):
    status, stdout, err = run_export("holmes.pt", tmp_path / "out", "--break", "rotary")
    assert status == 0, err
    assert float(stdout.split("largest difference from model.py ")[1].split()[0]) > 1.0
    assert "parts from cached.py after" in stdout and not (tmp_path / "out").exists()


def sha256s(folder):
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def a_previous_export(folder):
    folder.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (folder / name).write_text(f"an earlier {name}")
    return folder


def a_working_folder(tmp_path):
    """A reader's folder: the checkpoint and tokenizer it exports from, and a script."""
    for name in ("holmes.pt", "tokenizer.json"):
        shutil.copy(name, tmp_path / name)
    (tmp_path / "notes.py").write_text("print('keep me')")
    return tmp_path


# (arguments, what the one line says); {w} is a reader's working folder
NOTHING_LOST = {
    "the working folder as OUT_DIR": (["{w}/holmes.pt", "{w}", "--tokenizer", "{w}/tokenizer.json", "--force"],
                                      "also holds holmes.pt, mine, notes.py, old, which it would remove"),
    "a folder with other files": (["{w}/holmes.pt", "{w}/mine", "--tokenizer", "{w}/tokenizer.json", "--force"],
                                  "also holds notes.txt, null, which it would remove"),
    "an export holding the tokenizer it reads": (["{w}/holmes.pt", "{w}/old", "--tokenizer", "{w}/old/tokenizer.json",
                                                  "--force"], "holds {w}/old/tokenizer.json, which this export reads"),
    "an existing OUT_DIR without --force": (["{w}/holmes.pt", "{w}/old", "--tokenizer", "{w}/tokenizer.json"],
                                            "exists and is not empty; pass --force"),
    "the checkpoint as --gguf": (["{w}/holmes.pt", "--tokenizer", "{w}/tokenizer.json", "--gguf", "{w}/holmes.pt",
                                  "--force"], "it is {w}/holmes.pt, which this run reads"),
    "the tokenizer as --gguf": (["{w}/holmes.pt", "--tokenizer", "{w}/tokenizer.json", "--gguf",
                                 "{w}/tokenizer.json", "--force"], "it is {w}/tokenizer.json, which this run reads"),
    "a device as --gguf": (["{w}/holmes.pt", "--tokenizer", "{w}/tokenizer.json", "--gguf", "{w}/mine/null", "--force"],
                           "it is not a regular file"),
    "a device as OUT_DIR": (["{w}/holmes.pt", "{w}/mine/null", "--tokenizer", "{w}/tokenizer.json", "--force"],
                            "null exists and is not a folder"),
    "a folder as --gguf": (["{w}/holmes.pt", "--tokenizer", "{w}/tokenizer.json", "--gguf", "{w}/old", "--force"],
                           "it is a folder"),
    "a reader's file as --gguf": (["{w}/holmes.pt", "--tokenizer", "{w}/tokenizer.json", "--gguf", "{w}/notes.py",
                                   "--force"], "{w}/notes.py is not a file this command wrote, so --force does not "
                                               "replace it; move it or choose another name"),
    "an existing --gguf without --force": (["{w}/holmes.pt", "--tokenizer", "{w}/tokenizer.json", "--gguf",
                                            "{w}/notes.py"], "already exists; pass --force"),
    "the working folder as --ct2": (["{w}/holmes.pt", "--tokenizer", "{w}/tokenizer.json", "--ct2", "{w}", "--force"],
                                    "also holds holmes.pt, mine, notes.py, old and 1 more, which it would remove"),
    "a Hugging Face export as --ct2": (["{w}/holmes.pt", "--tokenizer", "{w}/tokenizer.json", "--ct2", "{w}/old",
                                        "--force"], "also holds model.safetensors, tokenizer.json, which it would"),
}


@pytest.mark.parametrize("case", NOTHING_LOST)
def test_nothing_is_lost_whatever_the_flags(case, tmp_path, monkeypatch):
    work = a_working_folder(tmp_path)
    (work / "mine").mkdir()
    (work / "mine" / "notes.txt").write_text("keep me")
    a_previous_export(work / "old")
    (work / "mine" / "null").symlink_to("/dev/null")
    before = sha256s(work)
    args, message = NOTHING_LOST[case]
    line = one_line_exit(command(export.main), monkeypatch, "export.py", *(a.format(w=work) for a in args))
    assert message.format(w=work) in line and "Traceback" not in line
    assert sha256s(work) == before and os.readlink(work / "mine" / "null") == "/dev/null"


# (where the reader is, arguments, what the one line says); {w} is a reader's working folder
NESTED = {
    "--gguf inside OUT_DIR": (".", ["holmes.pt", "out", "--gguf", "out/model.gguf"], "out/model.gguf is inside out"),
    "OUT_DIR inside --ct2": (".", ["holmes.pt", "ct2/hf", "--ct2", "ct2"], "ct2/hf is inside ct2"),
    "--gguf inside --ct2": (".", ["holmes.pt", "--ct2", "ct2", "--gguf", "./ct2/x.gguf"], "./ct2/x.gguf is inside ct2"),
    "OUT_DIR .": (".", ["holmes.pt", ".", "--force"], "OUT_DIR . is the working folder or holds it"),
    "OUT_DIR the folder above": ("mine", ["../holmes.pt", "..", "--tokenizer", "../tokenizer.json", "--force"],
                                 "OUT_DIR .. is the working folder or holds it"),
    "--ct2 the working folder by name": ("mine", ["../holmes.pt", "--tokenizer", "../tokenizer.json", "--ct2",
                                                 "{w}/mine"], "--ct2 DIR {w}/mine is the working folder or holds it"),
}


@pytest.mark.parametrize("case", NESTED)
def test_outputs_never_nest_or_swallow_the_working_folder(case, tmp_path, monkeypatch):
    work = a_working_folder(tmp_path)
    (work / "mine").mkdir()
    (work / "mine" / "notes.txt").write_text("keep me")
    before = sha256s(work)
    where, args, message = NESTED[case]
    monkeypatch.chdir(work / where)
    line = one_line_exit(command(export.main), monkeypatch, "export.py", *(a.format(w=work) for a in args))
    assert message.format(w=work) in line and "Traceback" not in line
    assert sha256s(work) == before and sorted(p.name for p in work.iterdir()) == ["holmes.pt", "mine", "notes.py",
                                                                                    "tokenizer.json"]


def swap_failure(tmp_path, monkeypatch, how):
    """Make put_in_place fail, as `how` says, once the previous export in tmp_path/out has been moved aside."""
    real_rename = os.rename

    def rename(src, dst):
        if os.path.basename(dst) == "out" and ".old-" in str(dst):  # the previous export just went aside
            real_rename(src, dst)
            if how == "a file added to it":
                (Path(dst) / "notes.txt").write_text("a reader's notes")
            elif how == "interrupted":
                raise KeyboardInterrupt
            return
        if how == "the second rename fails" and src == str(tmp_path / "built"):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        real_rename(src, dst)
    monkeypatch.setattr(export.os, "rename", rename)


@pytest.mark.parametrize("how, error, message", [
    ("the second rename fails", OSError, "Invalid cross-device link"),
    ("interrupted", KeyboardInterrupt, None),
    ("a file added to it", ValueError, "now holds notes.txt, which --force would remove"),
])
def test_a_failed_forced_swap_puts_the_previous_export_back(
        how, error, message, tmp_path, monkeypatch):
    a_previous_export(tmp_path / "out")
    (tmp_path / "built").mkdir()
    (tmp_path / "built" / "config.json").write_text("the new export")
    swap_failure(tmp_path, monkeypatch, how)
    before = sha256s(tmp_path / "out")
    with pytest.raises(error, match=message):
        export.put_in_place(str(tmp_path / "built"), str(tmp_path / "out"), True, export.HF_FILES)
    if how == "a file added to it":
        os.remove(tmp_path / "out" / "notes.txt")
    assert sha256s(tmp_path / "out") == before and sorted(p.name for p in tmp_path.iterdir()) == ["built", "out"]


def test_two_exports_into_one_folder_the_second_is_refused_and_the_first_kept(tmp_path, monkeypatch):
    first = a_previous_export(tmp_path / "first")
    real_report = export.report

    def another_export_finishes_meanwhile(*args):
        shutil.copytree(first, tmp_path / "out")
        return real_report(*args)
    monkeypatch.setattr(export, "report", another_export_finishes_meanwhile)
    line = one_line_exit(command(export.main), monkeypatch, "export.py", "holmes.pt", tmp_path / "out")
    assert line == f"export.py: error: {tmp_path / 'out'} appeared while this ran and is left as it was; nothing " \
                   "was written there (pass --force to replace it, or give another name)"
    assert sha256s(tmp_path / "out") == {tmp_path / "out" / p.relative_to(first): h for p, h in sha256s(first).items()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first", "out"]


@pytest.mark.parametrize("output", ["OUT_DIR", "--gguf"])
def test_a_file_size_limit_exporting_is_one_line_and_keeps_the_old_export(output, tmp_path, monkeypatch):
    a_previous_export(tmp_path / "out")
    (tmp_path / "model.gguf").write_bytes(b"GGUF, an earlier one")
    before = sha256s(tmp_path)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    writer = "write_folder" if output == "OUT_DIR" else "neox_state_dict"  # what comes right before each write

    def limited(*args, **kwargs):
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, limits[1]))
        return real(*args, **kwargs)
    real = getattr(export, writer)
    monkeypatch.setattr(export, writer, limited)
    args = [tmp_path / "out"] if output == "OUT_DIR" else ["--gguf", tmp_path / "model.gguf"]
    try:
        line = one_line_exit(command(export.main), monkeypatch, "export.py", "holmes.pt", *args, "--force")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    assert line.startswith("export.py: error: cannot write ") and line.endswith(": File too large; nothing was "
                                                                                "written there")
    assert sha256s(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "out"]


def test_force_replaces_a_previous_export_whole(tmp_path, run_export):
    out = a_previous_export(tmp_path / "holmes-hf")
    status, _, err = run_export("holmes.pt", out, "--force")
    assert status == 0, err
    assert (out / "config.json").read_text().startswith("{") and (out / "generation_config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["holmes-hf"]  # no temporary folder left


def test_an_interrupted_export_removes_its_temporary_folder_and_says_so_in_one_line(tmp_path):
    export = subprocess.Popen([sys.executable, "-m", "engines.export", "holmes.pt", tmp_path / "out"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not any(p.name.startswith(".export-") for p in tmp_path.iterdir()):  # the work has begun
        assert export.poll() is None
        time.sleep(0.05)
    export.send_signal(signal.SIGTERM)
    _, err = export.communicate(timeout=600)  # a guard against a hang only
    assert export.returncode == 1 and err.strip() == "python -m engines.export: interrupted; nothing half-written was left behind"
    assert list(tmp_path.iterdir()) == []


def test_a_missing_engine_is_one_line_naming_the_requirements_file(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # what a reader without the engines has
    assert one_line_exit(command(export.main), monkeypatch, "export.py", "holmes.pt", "--ct2", tmp_path / "ct2") == \
        "export.py: error: ctranslate2 is not installed; pip install -r engines/requirements.txt"
    assert list(tmp_path.iterdir()) == []


def test_a_tokenizer_of_another_size_is_refused_naming_both(tmp_path, monkeypatch):
    small_bpe(300).save(tmp_path / "small.json")
    message = one_line_exit(command(export.main), monkeypatch, "export.py", "holmes.pt", tmp_path / "out", "--tokenizer", tmp_path / "small.json")
    assert "small.json has 300 tokens but holmes.pt a vocabulary of 4096" in message
    assert not (tmp_path / "out").exists()


def test_a_missing_checkpoint_is_the_one_line_error_of_the_other_scripts(tmp_path, monkeypatch):
    assert one_line_exit(command(export.main), monkeypatch, "export.py", tmp_path / "nope.pt", tmp_path / "out") == \
        f"export.py: error: checkpoint {tmp_path / 'nope.pt'} not found; pass a Part 3 .pt file or train one"


def test_check_reads_as_transformers_does_and_fails_a_quarter_rotary(tmp_path, monkeypatch, capsys, shipped):
    write_folder(shipped, BPE.load("tokenizer.json"), tmp_path / "hf")
    monkeypatch.setattr(sys, "argv", ["export.py", "--check", str(tmp_path / "hf")])
    run_cli(export.main)
    assert "100 tokens: the same tokens as cached.py" in capsys.readouterr().out
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["rope_parameters"]["partial_rotary_factor"] = 0.25
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert one_line_exit(command(export.main), monkeypatch, "export.py", "--check", tmp_path / "hf") == \
        f"export.py: error: {tmp_path / 'hf'} does not reproduce holmes.pt"
    assert "parts from cached.py after" in capsys.readouterr().out
    assert one_line_exit(command(export.main), monkeypatch, "export.py", "--check", tmp_path) == \
        f"export.py: error: --check {tmp_path}: not a folder with a config.json; give an exported folder"


@pytest.fixture(scope="module")
def holmes_folder(tmp_path_factory, shipped):
    path = tmp_path_factory.mktemp("check") / "hf"
    write_folder(shipped, BPE.load("tokenizer.json"), path)
    return path


def swap_two_token_ids(folder):
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = (token for token, i in vocab.items() if i in (300, 301))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))


def negate_an_embedding_row(folder):
    weights = safetensors.torch.load_file(folder / "model.safetensors")
    weights["gpt_neox.embed_in.weight"][4000] *= -1  # a token the check's text never meets
    safetensors.torch.save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def edit_rotary_pct(folder):  # what transformers 4 and the engines' converters read; transformers 5 does not
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"rotary_pct": 0.25}))


@pytest.mark.parametrize("tamper, difference", [
    (swap_two_token_ids, "tokenizer.json: its model differs from the tokenizer's"),
    (negate_an_embedding_row, "model.safetensors: gpt_neox.embed_in.weight differs from the checkpoint's"),
    (edit_rotary_pct, "config.json: rotary_pct is 0.25, not 1.0"),
])
def test_check_refuses_a_folder_with_any_token_weight_or_config_field_changed(holmes_folder, tmp_path, tamper,
                                                                             difference, monkeypatch, capsys):
    folder = tmp_path / "hf"
    shutil.copytree(holmes_folder, folder)
    tamper(folder)
    assert one_line_exit(command(export.main), monkeypatch, "export.py", "--check", folder) == f"export.py: error: {folder} does not reproduce holmes.pt"
    assert difference in capsys.readouterr().out


def break_config(folder):
    (folder / "config.json").write_text("{not json")


def truncate_weights(folder):
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:len(data) // 2])


def break_tokenizer(folder):
    (folder / "tokenizer.json").write_text("not json")


@pytest.mark.parametrize("damage, reason", [
    (break_config, "OSError: It looks like the config file at"),
    (truncate_weights, "SafetensorError: "),
    (break_tokenizer, "JSONDecodeError: "),
])
def test_check_of_a_damaged_folder_is_one_line_naming_it(holmes_folder, tmp_path, damage, reason, monkeypatch, capsys):
    folder = tmp_path / "hf"
    shutil.copytree(holmes_folder, folder)
    damage(folder)
    message = one_line_exit(command(export.main), monkeypatch, "export.py", "--check", folder)
    assert message.startswith(f"export.py: error: --check {folder}: transformers cannot load it ({reason}")
    assert message.endswith("; export it again") and capsys.readouterr().out == ""


def test_a_gguf_type_the_models_shapes_cannot_hold_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    torch.manual_seed(0)
    save_checkpoint(CachedGPT(Config(d_model=48, n_heads=4, n_layers=1)), tmp_path / "odd.pt", 0)
    monkeypatch.setattr(export, "write_folder", lambda *a, **k: pytest.fail("the work began"))
    status, out, err = run_main(command(export.main), ["export.py", str(tmp_path / "odd.pt"), "--gguf", str(tmp_path / "m.gguf"),
                                              "--gguf-type", "q8_0"], monkeypatch, capsys)
    assert status == 1 and out == "" and err.splitlines()[-1] == (  # after a note of the tokenizer assumed
        "export.py: error: --gguf-type q8_0 stores each matrix's rows in blocks of 32 values, and this model's rows "
        "are d_model = 48 long, not a multiple of 32; use --gguf-type f16 or f32")
    assert os.listdir(tmp_path) == ["odd.pt"]
