"""bpe.py is Part 1's tokenizer: its file format, its training and its encoding."""
import itertools
import json
import os
import stat
import random
import re
import tempfile
from collections import Counter

import pytest

import bpe as bpe_module
from bpe import BPE, SPLIT_PATTERN
from helpers import ROOT, TEXT, assert_refused, assert_usage_error, run_main, sha256, special_input

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
    """Part 1's encoding rule, written out: lowest-id merge first, per chunk. This is the
    quadratic algorithm bpe.py used before its heap; the reference its ids must match."""
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


def test_cli_trains_writes_part1_format_and_refuses_a_missing_corpus(tmp_path, monkeypatch, capsys):
    status, out, err = train_bpe(tmp_path, TEXT.encode(), "--vocab", "300", monkeypatch=monkeypatch, capsys=capsys)
    assert status == 0 and err == "", err
    assert "round trip exact" in out
    assert BPE.load(tmp_path / "tok.json").merges == naive_train(TEXT, 44)
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(tmp_path / "tok.json").st_mode) == 0o666 & ~umask  # as open() makes a file, not 0600

    missing = tmp_path / "missing.txt"
    status, _, err = train_bpe(tmp_path, missing, "--out", tmp_path / "new.json", monkeypatch=monkeypatch,
                               capsys=capsys)
    assert status == 1 and err == f"bpe.py: error: corpus {str(missing)!r} is not a file; give a UTF-8 text file to " \
                                  "train on\n"


def test_an_existing_tokenizer_is_kept_unless_forced(tmp_path, monkeypatch, capsys, shipped_unchanged):
    (tmp_path / "mine.json").write_text('{"merges": [[104, 105]]}')
    for out in (os.path.join(ROOT, "tokenizer.json"), tmp_path / "mine.json"):
        before = sha256(out)
        run = train_bpe(tmp_path, TEXT.encode(), "--vocab", "300", "--out", out, monkeypatch=monkeypatch, capsys=capsys)
        assert_usage_error(run, f"{str(out)!r} exists; pass --force to replace it, or another --out")
        assert sha256(out) == before
    status, _, err = train_bpe(tmp_path, TEXT.encode(), "--vocab", "300", "--out", tmp_path / "mine.json", "--force",
                               monkeypatch=monkeypatch, capsys=capsys)
    assert status == 0 and len(BPE.load(tmp_path / "mine.json").merges) == 44, err


def test_force_replaces_only_a_tokenizer_never_a_users_file(tmp_path, monkeypatch, capsys, shipped_unchanged):
    """Before: bpe.py --out notes.txt --force replaced the notes."""
    (tmp_path / "notes.txt").write_text("a user's notes")
    forbid_training(monkeypatch)
    run = train_bpe(tmp_path, TEXT.encode(), "--out", tmp_path / "notes.txt", "--force", monkeypatch=monkeypatch,
                    capsys=capsys)
    assert_usage_error(run, f"{str(tmp_path / 'notes.txt')!r} is not a file this command wrote (not a tokenizer); "
                            "move it or choose another --out")
    assert (tmp_path / "notes.txt").read_text() == "a user's notes"


@pytest.mark.parametrize("ids, message", [
    ([-1], "token id -1 is outside the vocabulary"),
    ([4096], "token id 4096 is outside the vocabulary"),
    ([True], "token id True is not an integer"),
    ([3.0], "token id 3.0 is not an integer"),
    (["a"], "token id 'a' is not an integer"),
    ([None], "token id None is not an integer"),
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
    ('{"merges": [[' + "9" * 5000 + ", 2]]}", "t.json' holds a value JSON cannot be read into .*4300 digits"),
])
def test_hostile_tokenizer_files_are_refused_with_a_reason(tmp_path, content, message):
    path = tmp_path / "t.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        BPE.load(str(path))


def train_bpe(tmp_path, corpus, *args, monkeypatch, capsys):
    """bpe.py in-process on `corpus` (bytes, or a path as it is), writing tmp_path/tok.json unless told."""
    if isinstance(corpus, bytes):
        (tmp_path / "corpus.txt").write_bytes(corpus)
        corpus = tmp_path / "corpus.txt"
    args = args if "--out" in args else (*args, "--out", tmp_path / "tok.json")
    return run_main(bpe_module.main, ["bpe.py", corpus, *args], monkeypatch, capsys)


def random_text(seed, alphabet, n):
    rng = random.Random(seed)
    return "".join(rng.choice(alphabet) for _ in range(n))


OVERLAPPING = BPE.train("a" * 64 + " " + "ab" * 32 + " " + "aab" * 20, 256 + 30)  # merges of merges of a's


@pytest.mark.parametrize("bpe", [BPE.load(os.path.join(ROOT, "tokenizer.json")), OVERLAPPING],
                         ids=["shipped", "overlapping"])
@pytest.mark.parametrize("text", [
    TEXT, random_text(0, "ab ", 3000), random_text(1, "aaab", 1500), random_text(2, "etaoinshrdlu", 2000),
    random_text(3, "é中🕵a b\n\t'-1", 2000), random_text(4, "0123456789", 1000), "a" * 1501, "ab" * 700,
    "aab" * 500, "the" * 500, "-" * 999, " " * 1000 + "x", "\r\n" * 300, "Holmes" * 300,
])
def test_encode_gives_the_quadratic_references_ids(bpe, text):
    assert bpe.encode(text) == naive_encode(bpe.merges, text)


def test_the_chunk_cache_stays_bounded_and_long_chunks_skip_it(monkeypatch):
    monkeypatch.setattr(bpe_module, "CACHE_ENTRIES", 50)
    bpe = BPE.load(os.path.join(ROOT, "tokenizer.json"))
    words = " ".join(random_text(i, "abcdefghij", 6) for i in range(500))
    assert bpe.encode(words) == naive_encode(bpe.merges, words)
    assert 0 < len(bpe._chunk_cache) <= 50
    long = "Holmes" * 100
    assert bpe.encode(long) == naive_encode(bpe.merges, long) and long not in bpe._chunk_cache


@pytest.mark.parametrize("raw", [
    b"Line one.\r\nLine two.\r\n" * 40, b"Old Mac lines.\rAnother.\r" * 40, b"\xef\xbb\xbfA BOM first.\n" * 40,
    b"Mixed\r\n endings\n\r and\r\r\n more\n" * 40,
], ids=["crlf", "cr", "bom", "mixed"])
def test_the_round_trip_covers_the_corpus_files_exact_bytes(tmp_path, raw, monkeypatch, capsys, shipped_unchanged):
    status, out, err = train_bpe(tmp_path, raw, "--vocab", "260", monkeypatch=monkeypatch, capsys=capsys)
    assert status == 0 and err == "", err
    assert f"encoded {len(raw):,} bytes into" in out and "round trip exact" in out
    bpe = BPE.load(tmp_path / "tok.json")
    assert bpe.decode(bpe.encode(raw.decode())).encode() == raw


@pytest.mark.parametrize("raw, message", [
    (b"caf\xe9 au lait\n", "not UTF-8 (invalid continuation byte at byte 3)"),
    (b"Holmes \x80 Watson", "not UTF-8 (invalid start byte at byte 7)"),
    ("Watson\n".encode() * 200 + "é".encode()[:1], "not UTF-8 (unexpected end of data at byte 1,400)"),
    ("Holmes".encode("utf-16"), "not UTF-8 (invalid start byte at byte 0)"),
], ids=["latin-1", "stray-byte", "cut-at-end", "utf-16"])
def test_a_corpus_that_is_not_utf8_is_refused_naming_the_byte(tmp_path, raw, message, monkeypatch, capsys,
                                                              shipped_unchanged):
    assert_refused(train_bpe(tmp_path, raw, monkeypatch=monkeypatch, capsys=capsys), message)
    assert not (tmp_path / "tok.json").exists()


@pytest.mark.parametrize("raw, vocab, message", [
    (b"ab", 4096, "runs out of pairs after learning 1 of the 3,840 merges --vocab 4096 needs; pass --vocab 257"),
    (b"aaa", 300, "after learning 2 of the 44 merges --vocab 300 needs; pass --vocab 258 or less"),
    (b"x y z", 260, "after learning 2 of the 4 merges"),
    (b" ", 257, "after learning 0 of the 1 merges"),
    (TEXT.encode(), 65536, "of the 65,280 merges --vocab 65536 needs"),
], ids=["two-letters", "one-letter", "one-letter-words", "one-space", "tiny-for-the-vocab"])
def test_a_corpus_too_small_for_the_vocabulary_is_refused_before_writing(tmp_path, raw, vocab, message,
                                                                         monkeypatch, capsys, shipped_unchanged):
    (tmp_path / "tok.json").write_text('{"merges": [[104, 105]]}')  # --force may replace it, not with a short list
    before = sha256(tmp_path / "tok.json")
    run = train_bpe(tmp_path, raw, "--vocab", vocab, "--force", monkeypatch=monkeypatch, capsys=capsys)
    assert_refused(run, message)
    assert "pass --vocab" in run[2] and "or a bigger corpus" in run[2]
    assert sha256(tmp_path / "tok.json") == before


@pytest.mark.parametrize("vocab", ["4096", "256"])
def test_an_empty_corpus_is_refused_before_writing(tmp_path, vocab, monkeypatch, capsys, shipped_unchanged):
    (tmp_path / "tok.json").write_text('{"merges": [[104, 105]]}')
    before = sha256(tmp_path / "tok.json")
    run = train_bpe(tmp_path, b"", "--vocab", vocab, "--force", monkeypatch=monkeypatch, capsys=capsys)
    assert_refused(run, "corpus.txt' is empty; give a text to train on")
    assert sha256(tmp_path / "tok.json") == before


# /dev/zero would never end, a fifo would block until a writer comes: none is read
SPECIAL = [(kind, "is not a file") for kind in ("dev-zero", "link-to-dev-zero", "fifo", "folder", "missing")] + \
    [("too-big", "is larger than 1,000 bytes")]


@pytest.mark.parametrize("kind, message", SPECIAL)
def test_a_corpus_that_is_not_a_bounded_regular_file_is_refused(tmp_path, kind, message, monkeypatch, capsys,
                                                                 shipped_unchanged):
    monkeypatch.setattr(bpe_module, "MAX_CORPUS_BYTES", 1000)
    path = special_input(tmp_path, kind)
    run = train_bpe(tmp_path, path, monkeypatch=monkeypatch, capsys=capsys)
    assert_refused(run, f"bpe.py: error: corpus {str(path)!r} {message}; give a UTF-8 text file to train on")
    assert not (tmp_path / "tok.json").exists()


@pytest.mark.parametrize("kind, message", SPECIAL)
def test_a_tokenizer_file_that_is_not_a_bounded_regular_file_is_refused(tmp_path, kind, message, monkeypatch):
    monkeypatch.setattr(bpe_module, "MAX_TOKENIZER_BYTES", 1000)
    path = str(special_input(tmp_path, kind))
    with pytest.raises(ValueError, match=f"^tokenizer file {re.escape(repr(path))} {message}; pass a Part 1"):
        BPE.load(path)


def forbid_training(monkeypatch):
    def train(*args, **kwargs):
        raise AssertionError("the output should have been refused before training")
    monkeypatch.setattr(BPE, "train", train)


@pytest.mark.parametrize("out, flags, message", [
    ("", ["--force"], "--out '' is not a file to write"),
    ("{tmp}", ["--force"], "is not a file to write (a folder, a device or a pipe is never replaced); give a file name"),
    ("/dev/null", ["--force"], "--out '/dev/null' is not a file to write"),
    ("{tmp}/missing/tok.json", ["--force"], "missing' takes no new file (No such file or directory)"),
    ("/sys/tok.json", ["--force"], "the folder '/sys' takes no new file"),  # refuses even root
    ("{tmp}/victim.json", [], "victim.json' exists; pass --force"),
    ("{tmp}/link.json", [], "link.json' exists; pass --force"),
])
def test_an_output_that_cannot_or_must_not_be_written_is_refused_before_training(
        tmp_path, out, flags, message, monkeypatch, capsys, shipped_unchanged):
    (tmp_path / "corpus.txt").write_text(TEXT)
    (tmp_path / "victim.json").write_text('{"merges": [[104, 105]]}')
    (tmp_path / "link.json").symlink_to(tmp_path / "victim.json")
    before = sha256(tmp_path / "victim.json")
    forbid_training(monkeypatch)
    run = train_bpe(tmp_path, tmp_path / "corpus.txt", *flags, "--out", out.format(tmp=tmp_path),
                    monkeypatch=monkeypatch, capsys=capsys)
    assert_usage_error(run, message)
    assert sha256(tmp_path / "victim.json") == before and (tmp_path / "link.json").is_symlink()


def test_no_link_at_the_output_or_at_a_temporary_name_is_written_through(tmp_path, monkeypatch, capsys,
                                                                          shipped_unchanged):
    (tmp_path / "corpus.txt").write_text(TEXT)
    (tmp_path / "victim.json").write_text('{"merges": [[104, 105]]}')
    before = sha256(tmp_path / "victim.json")
    traps = ["tok.json", "tok.json.tmp", ".tok.json.tmp", ".tok.json.planted.tmp"]
    for name in traps:
        (tmp_path / name).symlink_to(tmp_path / "victim.json")
    # the first temporary name tried is the planted link's, as an old interrupted run could have left it
    names = tempfile._get_candidate_names
    monkeypatch.setattr(tempfile, "_get_candidate_names", lambda: itertools.chain(["planted"], names()))
    status, out, err = train_bpe(tmp_path, tmp_path / "corpus.txt", "--vocab", "300", "--force",
                                 monkeypatch=monkeypatch, capsys=capsys)
    assert status == 0, err
    assert sha256(tmp_path / "victim.json") == before
    assert all((tmp_path / name).is_symlink() for name in traps[1:])
    assert not (tmp_path / "tok.json").is_symlink() and len(BPE.load(tmp_path / "tok.json").merges) == 44


def test_an_interrupted_write_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch, shipped_unchanged):
    (tmp_path / "corpus.txt").write_text(TEXT)
    (tmp_path / "tok.json").write_text('{"merges": [[104, 105]]}')
    before = sha256(tmp_path / "tok.json")

    def cut(data, f):
        f.write('{"merges": [[')
        raise KeyboardInterrupt  # Ctrl-C halfway through the write
    monkeypatch.setattr(json, "dump", cut)
    argv = ["bpe.py", tmp_path / "corpus.txt", "--vocab", "300", "--out", tmp_path / "tok.json", "--force"]
    monkeypatch.setattr("sys.argv", [str(a) for a in argv])
    with pytest.raises(KeyboardInterrupt):
        bpe_module.main()
    assert sha256(tmp_path / "tok.json") == before
    assert sorted(os.listdir(tmp_path)) == ["corpus.txt", "tok.json"]


def test_training_shows_its_progress_on_stderr(capsys):
    bpe = BPE.train(random_text(5, "abcdefghijklmnop ", 20_000), 256 + 600, progress=True)
    out, err = capsys.readouterr()
    assert bpe.vocab_size == 256 + 600 and out == ""
    assert [line.split(" in ")[0] for line in err.splitlines()] == ["merges: 256/600", "merges: 512/600"]
