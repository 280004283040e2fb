"""Byte-level BPE, exactly as Part 1 of the series defines it.

Ids 0-255 are raw bytes; the merge at index i of the merge list gets id 256 + i.
Text is split into chunks with a GPT-2 style pattern and merges never cross a
chunk boundary. The file format is Part 1's: {"merges": [[a, b], ...]}, so a
tokenizer.json written by Part 1 loads and encodes here unchanged.

    python bpe.py CORPUS [--vocab 4096] [--out tokenizer.json] [--force]

trains a tokenizer on a text file, checks the round trip over the file's exact
bytes and writes the file.
"""
import argparse
import hashlib
import heapq
import json
import operator
import os
import sys
import tempfile
import time
from collections import Counter

import regex

MAX_MERGES = 65536 - 256  # ids must fit uint16, as Part 3's training stores them
MAX_TOKEN_BYTES = 4096  # far above any real merge list; stops a file that would build gigabyte tokens
MAX_TOKENIZER_BYTES = 16 * 2**20  # 65,280 merges pretty-printed take under 4 MB
MAX_CORPUS_BYTES = 256 * 2**20  # 70 times the Holmes canon; encoding holds every id as a Python int
CACHE_CHUNK_CHARS = 32  # words this long or shorter are cached; longer chunks are rare in prose
CACHE_ENTRIES = 2**16  # the Holmes canon has 29k distinct chunks; a hostile text only refills the cache

SPLIT_PATTERN = regex.compile(
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)


def check_file(path, what, max_bytes, hint=""):
    """A regular file of at most max_bytes, or a ValueError naming it."""
    if not os.path.isfile(path):
        raise ValueError(f"{what} {path!r} is not a file{'; ' + hint if hint else ''}")
    if os.path.getsize(path) > max_bytes:
        raise ValueError(f"{what} {path!r} is larger than {max_bytes:,} bytes{'; ' + hint if hint else ''}")


def utf8_bytes(text):
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text cannot be UTF-8 encoded ({e.reason} at index {e.start}); "
                         "remove lone surrogates before tokenizing") from None


def read_corpus(path, hint=""):
    """A text file exactly as its bytes say (no newline translation), or a one-line error."""
    check_file(path, "corpus", MAX_CORPUS_BYTES, hint)
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"corpus {path!r} is not UTF-8 ({e.reason} at byte {e.start:,}); "
                         "convert it to UTF-8 first") from None


def pairs_of(ids):
    return zip(ids, ids[1:])


def merge_pair(ids, pair, new_id):
    """Replace every occurrence of pair in ids, left to right."""
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and ids[i] == pair[0] and ids[i + 1] == pair[1]:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


class BPE:
    def __init__(self, merges):
        self.merges = [tuple(m) for m in merges]
        self.rank = {pair: 256 + i for i, pair in enumerate(self.merges)}
        self.vocab = [bytes([b]) for b in range(256)]
        for a, b in self.merges:
            self.vocab.append(self.vocab[a] + self.vocab[b])
        self._chunk_cache = {}

    @property
    def vocab_size(self):
        return len(self.vocab)

    def record(self):
        """What a checkpoint keeps of the tokenizer it was trained with: a hash of the merges."""
        merges = json.dumps([list(m) for m in self.merges], separators=(",", ":"))
        return {"sha256": hashlib.sha256(merges.encode()).hexdigest(), "vocab_size": self.vocab_size}

    @classmethod
    def load(cls, path):
        check_file(path, "tokenizer file", MAX_TOKENIZER_BYTES, "pass a Part 1 tokenizer.json")
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path!r} is not valid JSON ({e}); expected {{\"merges\": [[a, b], ...]}}") from None
        except ValueError as e:  # an integer of thousands of digits: past Python's limit for converting one
            raise ValueError(f"{path!r} holds a value JSON cannot be read into ({e}); expected {{\"merges\": [[a, b], ...]}}") from None
        except RecursionError:
            raise ValueError(f"{path!r} is nested too deeply to be a tokenizer; expected {{\"merges\": [[a, b], ...]}}") from None
        if not isinstance(data, dict) or set(data) != {"merges"} or not isinstance(data["merges"], list):
            raise ValueError(f"{path!r} must hold exactly {{\"merges\": [[a, b], ...]}}")
        if len(data["merges"]) > MAX_MERGES:
            raise ValueError(f"{path!r} has {len(data['merges']):,} merges; at most {MAX_MERGES:,} fit uint16 ids")
        lengths = [1] * 256
        for i, m in enumerate(data["merges"]):
            ok = isinstance(m, list) and len(m) == 2 and all(type(x) is int for x in m)
            if not ok:
                raise ValueError(f"{path!r}: merge {i} is {m!r}, expected a pair of integer ids")
            if not all(0 <= x < 256 + i for x in m):
                raise ValueError(
                    f"{path!r}: merge {i} {m} names an id not yet defined (ids so far are 0..{255 + i})"
                )
            lengths.append(lengths[m[0]] + lengths[m[1]])
            if lengths[-1] > MAX_TOKEN_BYTES:
                raise ValueError(f"{path!r}: merge {i} builds a token of {lengths[-1]:,} bytes; "
                                 f"a real tokenizer's tokens are far shorter than {MAX_TOKEN_BYTES:,}")
        return cls(data["merges"])

    def save(self, path, force=False):
        """Part 1's format, through a temporary file and a rename: a cut write leaves the old file whole,
        and an existing file is replaced only with force."""
        f = tempfile.NamedTemporaryFile("w", dir=os.path.dirname(os.path.abspath(path)), prefix=".tokenizer-",
                                        encoding="utf-8", delete=False)
        try:  # removed however this ends, Ctrl-C in json.dump included
            with f:
                json.dump({"merges": [list(m) for m in self.merges]}, f)
            umask = os.umask(0o022)  # read back as it is set: the only way to read it
            os.umask(umask)
            os.chmod(f.name, 0o666 & ~umask)  # as open() would make it, not the temporary's private 0600
            (os.replace if force else os.link)(f.name, path)  # os.link never replaces what stands at path
        finally:
            if os.path.lexists(f.name):
                os.unlink(f.name)

    def _merge_all(self, ids):
        """Part 1's rule in O(n log n): the lowest-id merge first, its occurrences left to right.

        A heap holds (id the pair merges into, position of its left symbol) for every
        adjacent pair in the merge list; the symbols are a linked list, so a merge is O(1)
        and pushes only the two pairs it makes. Those pairs merge into higher ids than the
        one being applied (a merge only names ids learned before it), so ids come off the
        heap in rising order and each id's occurrences by position, left to right. An entry
        whose pair has since changed (a neighbour merged first) is skipped when it comes up.
        """
        rank, merges, push, pop = self.rank, self.merges, heapq.heappush, heapq.heappop
        n = len(ids)
        shift = n.bit_length()  # an entry is one int, (new id << shift) | position: compares fast
        left, right = list(range(-1, n - 1)), list(range(1, n + 1))
        heap = [rank[p] << shift | i for i, p in enumerate(pairs_of(ids)) if p in rank]
        heapq.heapify(heap)
        mask = (1 << shift) - 1
        while heap:
            entry = pop(heap)
            new_id, i = entry >> shift, entry & mask
            j = right[i]
            if j == n or merges[new_id - 256] != (ids[i], ids[j]):
                continue  # stale: i or j was merged away (None) or into something else
            ids[i], ids[j] = new_id, None
            right[i] = k = right[j]
            a = left[i]
            if a >= 0 and (ids[a], new_id) in rank:
                push(heap, rank[ids[a], new_id] << shift | a)
            if k < n:
                left[k] = i
                if (new_id, ids[k]) in rank:
                    push(heap, rank[new_id, ids[k]] << shift | i)
        return [t for t in ids if t is not None]

    def _encode_chunk(self, chunk):
        ids = self._chunk_cache.get(chunk)
        if ids is None:
            ids = self._merge_all(list(utf8_bytes(chunk)))
            if len(chunk) <= CACHE_CHUNK_CHARS:
                if len(self._chunk_cache) >= CACHE_ENTRIES:
                    self._chunk_cache.clear()
                self._chunk_cache[chunk] = ids
        return ids

    def encode(self, text):
        utf8_bytes(text)
        out = []
        for chunk in SPLIT_PATTERN.findall(text):
            out.extend(self._encode_chunk(chunk))
        return out

    def decode(self, ids):
        ids = list(ids)
        odd = next((repr(i) for i in ids if isinstance(i, bool) or not hasattr(i, "__index__")), None)
        if odd:  # True, 3.0 or 'a' would otherwise decode as some token, or fail deep inside
            raise ValueError(f"token id {odd} is not an integer")
        ids = [operator.index(i) for i in ids]
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary 0..{self.vocab_size - 1}")
        return b"".join(self.vocab[i] for i in ids).decode("utf-8", errors="replace")

    @classmethod
    def train(cls, text, vocab_size, progress=False):
        """Learn up to vocab_size - 256 merges (fewer if the text runs out of pairs),
        updating pair counts incrementally.

        Each merge touches only the chunks that contain the merged pair; a
        max-heap with lazy deletion finds the most frequent pair, ties going
        to the smallest pair so training is deterministic. progress: show how
        far it is on stderr.
        """
        if vocab_size < 256:
            raise ValueError(f"vocab_size must be at least 256, got {vocab_size}")
        chunk_counts = Counter(SPLIT_PATTERN.findall(text))
        chunks = [list(utf8_bytes(c)) for c in chunk_counts]
        weights = list(chunk_counts.values())
        counts = Counter()
        where = {}
        for ci, (ids, w) in enumerate(zip(chunks, weights)):
            for p in pairs_of(ids):
                counts[p] += w
                where.setdefault(p, set()).add(ci)
        heap = [(-c, p) for p, c in counts.items()]
        heapq.heapify(heap)

        merges, start = [], time.time()
        n_merges = vocab_size - 256
        while len(merges) < n_merges and heap:
            neg, pair = heapq.heappop(heap)
            if counts.get(pair, 0) != -neg or neg == 0:
                continue
            new_id = 256 + len(merges)
            merges.append(pair)
            touched = set()
            for ci in where.pop(pair):
                old, w = chunks[ci], weights[ci]
                new = merge_pair(old, pair, new_id)
                for p in pairs_of(old):
                    counts[p] -= w
                    touched.add(p)
                for p in pairs_of(new):
                    counts[p] += w
                    touched.add(p)
                    where.setdefault(p, set()).add(ci)
                chunks[ci] = new
            for p in touched:
                if counts[p] > 0:
                    heapq.heappush(heap, (-counts[p], p))
                else:
                    counts.pop(p)
            if progress and len(merges) % 256 == 0:
                print(f"merges: {len(merges):,}/{n_merges:,} in {time.time() - start:.0f}s", file=sys.stderr)
        return cls(merges)


def is_tokenizer(path):
    """Whether `path` holds a tokenizer (what this script writes): --force replaces nothing else."""
    try:
        return BPE.load(path) is not None
    except (ValueError, OSError):
        return False


def main():
    ap = argparse.ArgumentParser(description="Train a byte-level BPE tokenizer on a text file.")
    ap.add_argument("corpus", help="UTF-8 text file to train on")
    ap.add_argument("--vocab", type=int, default=4096, help="vocabulary size (default 4096)")
    ap.add_argument("--out", default="tokenizer.json", help="where to write the merges")
    ap.add_argument("--force", action="store_true", help="replace an existing --out file")
    args = ap.parse_args()
    if not 256 <= args.vocab <= 256 + MAX_MERGES:
        ap.error(f"--vocab must be in 256..{256 + MAX_MERGES}, got {args.vocab}")
    if not args.out or os.path.exists(args.out) and not os.path.isfile(args.out):
        ap.error(f"--out {args.out!r} is not a file to write (a folder, a device or a pipe is never replaced); "
                 "give a file name")
    if os.path.lexists(args.out) and not args.force:
        ap.error(f"{args.out!r} exists; pass --force to replace it, or another --out")
    if os.path.exists(args.out) and os.path.exists(args.corpus) and os.path.samefile(args.out, args.corpus):
        ap.error(f"--out {args.out!r} is the corpus itself; give another path")
    if os.path.isfile(args.out) and not os.path.islink(args.out) and not is_tokenizer(args.out):  # a link: only it goes
        ap.error(f"{args.out!r} is not a file this command wrote (not a tokenizer); move it or choose another --out")
    folder = os.path.dirname(os.path.abspath(args.out))
    try:  # the folder takes a new file, tried before training: the one test that also holds for root
        tempfile.NamedTemporaryFile(dir=folder).close()
    except OSError as e:
        ap.error(f"cannot write --out {args.out!r}: the folder {folder!r} takes no new file ({e.strerror}); "
                 "give a path in a writable folder")
    try:
        train(args)
    except (ValueError, OSError) as e:  # the corpus or --out: what the user gave
        sys.exit(f"bpe.py: error: {e}")


def train(args):
    text = read_corpus(args.corpus, "give a UTF-8 text file to train on")
    if not text:
        raise ValueError(f"corpus {args.corpus!r} is empty; give a text to train on")
    t0 = time.time()
    bpe = BPE.train(text, args.vocab, progress=True)
    t_train = time.time() - t0
    if bpe.vocab_size < args.vocab:
        raise ValueError(f"corpus {args.corpus!r} runs out of pairs after learning {len(bpe.merges):,} of the "
                         f"{args.vocab - 256:,} merges --vocab {args.vocab} needs; pass --vocab {bpe.vocab_size} "
                         "or less, or a bigger corpus")
    t0 = time.time()
    ids = bpe.encode(text)
    t_encode = time.time() - t0
    if bpe.decode(ids) != text:
        raise ValueError("round trip failed: decode(encode(corpus)) differs from the corpus")
    bpe.save(args.out, args.force)
    n_bytes = len(text.encode("utf-8"))
    print(f"trained {bpe.vocab_size:,} tokens in {t_train:.1f}s; wrote {args.out}")
    print(f"encoded {n_bytes:,} bytes into {len(ids):,} tokens in {t_encode:.1f}s "
          f"({n_bytes / len(ids):.2f} bytes/token); round trip exact")


if __name__ == "__main__":
    main()
