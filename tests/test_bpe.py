"""bpe.py is Part 1's tokenizer: its file format, its training and its encoding."""
import json
import subprocess
import sys
from collections import Counter

import pytest

from bpe import BPE, SPLIT_PATTERN

TEXT = (
    "It is a capital mistake to theorize before one has data. Insensibly one begins "
    "to twist facts to suit theories, instead of theories to suit facts. "
    "You see, but you do not observe. The distinction is clear. I'll, we've, they're 42 times!\n\n"
) * 3


def naive_train(text, n_merges):
    """Part 1 trained the slow way: recount every pair for every merge."""
    chunks = Counter(SPLIT_PATTERN.findall(text))
    words = {c: list(c.encode()) for c in chunks}
    merges = []
    for i in range(n_merges):
        counts = Counter()
        for c, ids in words.items():
            for p in zip(ids, ids[1:]):
                counts[p] += chunks[c]
        if not counts:
            break
        top = max(counts.values())
        pair = min(p for p, n in counts.items() if n == top)
        merges.append(pair)
        for c, ids in words.items():
            out, j = [], 0
            while j < len(ids):
                if ids[j:j + 2] == list(pair):
                    out.append(256 + i)
                    j += 2
                else:
                    out.append(ids[j])
                    j += 1
            words[c] = out
    return merges


def naive_encode(merges, text):
    """Part 1's encoding rule, written out: lowest-id merge first, per chunk."""
    rank = {tuple(m): 256 + i for i, m in enumerate(merges)}
    out = []
    for chunk in SPLIT_PATTERN.findall(text):
        ids = list(chunk.encode())
        while True:
            candidates = [(rank[p], j) for j, p in enumerate(zip(ids, ids[1:])) if p in rank]
            if not candidates:
                break
            new_id = min(candidates)[0]
            pair = merges[new_id - 256]
            j, merged = 0, []
            while j < len(ids):
                if j + 1 < len(ids) and (ids[j], ids[j + 1]) == tuple(pair):
                    merged.append(new_id)
                    j += 2
                else:
                    merged.append(ids[j])
                    j += 1
            ids = merged
        out.extend(ids)
    return out


def test_incremental_training_learns_the_same_merges_as_recounting():
    assert BPE.train(TEXT, 256 + 60).merges == naive_train(TEXT, 60)


def test_a_part1_file_written_by_other_code_loads_and_encodes_as_part1(tmp_path):
    merges = [list(m) for m in naive_train(TEXT, 40)]
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"merges": merges}))
    bpe = BPE.load(path)
    for text in (TEXT, "theorize the data, twisting facts", "unseen: Baskerville!"):
        assert bpe.encode(text) == naive_encode(merges, text)
    bpe.save(tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text()) == {"merges": merges}


def test_shipped_tokenizer_has_4096_tokens_and_splits_like_part1():
    bpe = BPE.load("tokenizer.json")
    assert bpe.vocab_size == 4096
    text = "Holmes said, 'You have been in Afghanistan, I perceive.'  \n\n 1895"
    assert bpe.encode(text) == naive_encode(bpe.merges, text)
    assert SPLIT_PATTERN.findall("I'll see  you") == ["I", "'ll", " see", " ", " you"]


@pytest.mark.parametrize("text", [
    "", "🕵️‍♂️ 🔍🎻", "café naïve Zürich señor", "Xyzzyquux flibbertigibbet", " " * 40 + "\t\n\n\n   x   ",
    "\u00a0non-breaking\u2003em space", "中文 العربية",
])
def test_round_trip_is_exact(text):
    bpe = BPE.load("tokenizer.json")
    assert bpe.decode(bpe.encode(text)) == text


def test_decode_replaces_a_split_utf8_sequence():
    bpe = BPE.load("tokenizer.json")
    assert bpe.decode(list("é".encode())[:1]) == "\ufffd"


def test_lone_surrogate_is_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="cannot be UTF-8 encoded"):
        BPE.load("tokenizer.json").encode("bad \ud800 text")


@pytest.mark.parametrize("content, message", [
    ("{not json", "not valid JSON"),
    ('{"merges": [[1, 2]], "vocab": {}}', "exactly"),
    ('[[1, 2]]', "exactly"),
    ('{"merges": [[1, 2, 3]]}', "merge 0"),
    ('{"merges": [[1, "a"]]}', "merge 0"),
    ('{"merges": [[1, 2], [256, 300]]}', "merge 1 .* not yet defined"),
])
def test_malformed_tokenizer_file_gets_a_one_line_error(tmp_path, content, message):
    path = tmp_path / "tokenizer.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        BPE.load(path)


def test_missing_tokenizer_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.json"):
        BPE.load(tmp_path / "nowhere.json")


def test_cli_trains_writes_part1_format_and_refuses_a_missing_corpus(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    out = tmp_path / "tok.json"
    run = subprocess.run([sys.executable, "bpe.py", str(corpus), "--vocab", "300", "--out", str(out)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "round trip exact" in run.stdout
    assert BPE.load(out).merges == naive_train(TEXT, 44)

    run = subprocess.run([sys.executable, "bpe.py", str(tmp_path / "missing.txt")], capture_output=True, text=True)
    assert run.returncode != 0
    assert run.stderr.strip().splitlines() == [f"bpe.py: error: corpus {tmp_path / 'missing.txt'} not found"]


def test_an_existing_tokenizer_is_kept_unless_forced(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    shipped = open("tokenizer.json", "rb").read()
    for out in ("tokenizer.json", tmp_path / "mine.json"):
        if out != "tokenizer.json":
            out.write_text("my own")
        before = open(out, "rb").read()
        run = subprocess.run([sys.executable, "bpe.py", str(corpus), "--vocab", "300", "--out", str(out)],
                             capture_output=True, text=True)
        assert run.returncode == 1 and "already exists; pass --force" in run.stderr and "Traceback" not in run.stderr
        assert open(out, "rb").read() == before
    assert open("tokenizer.json", "rb").read() == shipped
    run = subprocess.run([sys.executable, "bpe.py", str(corpus), "--vocab", "300", "--out", str(tmp_path / "mine.json"),
                          "--force"], capture_output=True, text=True)
    assert run.returncode == 0 and len(BPE.load(tmp_path / "mine.json").merges) == 44


@pytest.mark.parametrize("ids, message", [
    ([-1], "token id -1 is outside the vocabulary"),
    ([4096], "token id 4096 is outside the vocabulary"),
    ([True], "token id True is not an integer"),
    ([3.0], "token id 3.0 is not an integer"),
    (["a"], "token id 'a' is not an integer"),
])
def test_decode_refuses_ids_it_does_not_have(ids, message):
    with pytest.raises(ValueError, match=message):
        BPE.load("tokenizer.json").decode(ids)


def test_decode_accepts_integer_likes():
    import numpy as np
    bpe = BPE.load("tokenizer.json")
    ids = bpe.encode("Holmes")
    assert bpe.decode(np.array(ids)) == bpe.decode([int(i) for i in ids]) == "Holmes"


@pytest.mark.parametrize("content, message", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    (json.dumps({"merges": [[97, 97]] + [[256 + i, 256 + i] for i in range(40)]}), "builds a token of"),
    (json.dumps({"merges": [[0, 0]] * 70_000}), "at most 65,280 fit uint16 ids"),
])
def test_hostile_tokenizer_files_are_refused_with_a_reason(tmp_path, content, message):
    path = tmp_path / "t.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        BPE.load(path)
