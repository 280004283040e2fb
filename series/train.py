"""Part 3's training recipe, to make the checkpoint every other script uses.

    python -m series.train --corpus PATH [--steps 1500] [--out holmes] [--device cpu|cuda] [--resume | --force]

The corpus is tokenized once (the ids are cached under data/). Batches of
32 x 256 random windows from the first 90%; AdamW with warmup and cosine
decay; every 250 steps the mean loss of 20 train and 20 val batches goes to
NAME.csv and the best-val model to NAME.pt, in Part 3's checkpoint format
plus a record of the tokenizer it was trained with. NAME.resume.pt holds
what a cut-short run needs to go on with --resume, and which run it is: a
resume with another corpus, tokenizer or setting is refused. A run that
finishes removes it. A loss that is not finite stops the run. Every file is
written through a temporary file and a rename, and an existing one is
replaced only with --force or --resume.
"""
import argparse
import contextlib
import csv
import hashlib
import math
import os
import signal
import sys
import tempfile
import time
import zipfile

import numpy as np
import torch

from bpe import BPE, read_corpus
from model import GPT, Config

BATCH = 32
CACHE_DIR = "data"
COLUMNS = ["step", "train_loss", "val_loss", "tokens_per_sec", "elapsed_sec"]


def is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


RESUME_KINDS = {  # what a resume file holds: each key's kind, and the test of it
    "run": ("a dict", lambda v: isinstance(v, dict)),
    "model": ("a state dict", lambda v: isinstance(v, dict)),
    "optimizer": ("an optimizer state dict", lambda v: isinstance(v, dict)),
    "generator": ("a uint8 tensor", lambda v: isinstance(v, torch.Tensor) and v.dtype == torch.uint8),
    "step": ("a whole number >= 0", lambda v: type(v) is int and v >= 0),
    "best_val": ("a loss", lambda v: is_number(v) and not math.isnan(v)),
    "elapsed": ("a finite number of seconds >= 0", lambda v: is_number(v) and math.isfinite(v) and v >= 0),
}


@contextlib.contextmanager
def atomic_write(path, replace, mode="wb", **open_args):
    """Write `path` through a temporary file beside it, then put that in place: a cut write leaves the old file
    whole. Without `replace` it is linked into place, and os.link never replaces a file that appeared meanwhile."""
    f = tempfile.NamedTemporaryFile(mode, dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp", delete=False,
                                    **open_args)
    try:
        try:
            with f:
                yield f
        except RuntimeError as e:  # Ctrl-C or SIGTERM inside torch.save, which its C++ writer turns into this
            if isinstance(e.__context__, KeyboardInterrupt):
                raise KeyboardInterrupt from None
            raise
        umask = os.umask(0o022)  # read back as it is set: the only way to read it
        os.umask(umask)
        os.chmod(f.name, 0o666 & ~umask)  # as open() would make it, not the temporary's private 0600
        (os.replace if replace else os.link)(f.name, path)
    finally:
        if os.path.exists(f.name):
            os.unlink(f.name)


def check_folder(folder):
    """A folder this run can make files in, tried by making one (the test that also holds for root)."""
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise ValueError(f"cannot write files in {folder!r}: {e.strerror}") from None


def written_here(path):
    """Whether the file at `path` is one this script writes: the log with its header, a checkpoint or a resume
    file with their keys (read as data, mapped, not read whole)."""
    try:
        if path.endswith(".csv"):
            with open(path, newline="") as f:
                return f.readline(200).rstrip("\r\n") == ",".join(COLUMNS)
        keys = set(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
    except Exception:  # not one: unreadable, not a torch.save file, not a dict
        return False
    if path.endswith(".resume.pt"):
        return set(RESUME_KINDS) <= keys
    return keys == {"model", "config", "step", "tokenizer"}


def check_outputs(name, force, resume, inputs):
    """Before any long work: NAME.pt, NAME.csv and NAME.resume.pt can be written, one that exists is replaced
    only when told (--force, or --resume, which reads and checks them first), with --force only if this script
    wrote it, and never one of the run's `inputs`."""
    if not os.path.basename(name):
        raise ValueError(f"--out {name!r} names no run; give a name like holmes or runs/holmes")
    paths = [f"{name}.pt", f"{name}.csv", f"{name}.resume.pt"]
    for path in paths:
        try:
            os.lstat(path)
        except FileNotFoundError:
            continue
        except OSError as e:  # a name longer than the folder holds
            raise ValueError(f"cannot write {path!r}: {e.strerror}; give a shorter --out") from None
        if any(os.path.exists(given) and os.path.exists(path) and os.path.samefile(given, path) for given in inputs):
            raise ValueError(f"--out {name!r} would write {path!r}, which this run reads; give another name")
        if os.path.exists(path) and not os.path.isfile(path):  # whatever the flags: replacing it would lose it
            raise ValueError(f"cannot write {path!r}: it is not a regular file (a folder, a pipe, a device or a link "
                             "to one); give another --out")
        if not (force or resume):
            cut = f", or --resume to go on from the cut-short run in {paths[2]!r}" if os.path.lexists(paths[2]) else ""
            raise ValueError(f"{path!r} already exists; pass --force to replace it, or --out NAME for a new run{cut}")
        # with --force, only a file this script wrote (a link is replaced, never what it points at)
        if force and os.path.isfile(path) and not os.path.islink(path) and not written_here(path):
            raise ValueError(f"{path!r} is not a file this command wrote; move it or choose another --out")
    check_folder(os.path.dirname(name) or ".")


def cache_path(corpus_sha, tokenizer_sha):
    """data/ids-KEY.npy for this corpus and these merges; if it is not there yet, its folder is
    made and tried, so a run never tokenizes for nothing."""
    key = hashlib.sha256(f"{corpus_sha} {tokenizer_sha}".encode()).hexdigest()[:16]
    path = os.path.join(CACHE_DIR, f"ids-{key}.npy")
    if os.path.isfile(path):
        return path
    if os.path.lexists(CACHE_DIR) and not os.path.isdir(CACHE_DIR):
        raise ValueError(f"{CACHE_DIR!r} is not a folder, but train.py caches token ids in {CACHE_DIR}/; move it away")
    os.makedirs(CACHE_DIR, exist_ok=True)
    check_folder(CACHE_DIR)
    return path


def load_ids(text, tokenizer, cache, corpus, needed):
    """The corpus as uint16 ids: from the cache, or tokenized once and cached; refused, before anything is
    printed or cached, if they are fewer than `needed`."""
    if os.path.isfile(cache):
        ids = read_ids(cache, tokenizer.vocab_size)
    else:
        t0 = time.time()
        ids = np.array(tokenizer.encode(text), dtype=np.uint16)
    if len(ids) < needed:
        too_few(corpus, f"{len(ids):,} tokens", needed)
    if os.path.isfile(cache):
        return ids
    with atomic_write(cache, replace=True) as f:  # what may stand there is the same ids, cached by another run
        np.save(f, ids)
    print(f"tokenized {len(text.encode()):,} bytes into {len(ids):,} tokens in {time.time() - t0:.1f}s",
          file=sys.stderr)
    return ids


def too_few(corpus, size, needed):
    raise ValueError(f"corpus {corpus!r} gives {size}; at least {needed:,} tokens are needed for the last 10% to "
                     "hold one validation window; give a longer text")


def read_ids(cache, vocab_size):
    """The cached ids, or a one-line error naming the cache file: it is only a copy, so the way on is to remove it."""
    way_on = "remove it and train.py tokenizes the corpus again"
    try:
        ids = np.load(cache, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"the token id cache {cache} cannot be read ({e}); {way_on}") from None
    if ids.dtype != np.uint16 or ids.ndim != 1:
        raise ValueError(f"the token id cache {cache} holds {ids.dtype} of shape {ids.shape}, not a row "
                         f"of uint16 ids; {way_on}")
    if len(ids) and int(ids.max()) >= vocab_size:
        raise ValueError(f"the token id cache {cache} holds id {int(ids.max())}, outside the tokenizer's "
                         f"0..{vocab_size - 1}; {way_on}")
    return ids


def batch(data, context, gen, device):
    ix = torch.randint(len(data) - context - 1, (BATCH,), generator=gen)
    x = torch.stack([data[i:i + context] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + context] for i in ix])
    return x.to(device), y.to(device)


def lr_at(step, steps, lr):
    warmup = min(200, steps // 10)
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def evaluate(model, splits, context, n_batches, device, autocast):
    model.eval()
    gen = torch.Generator().manual_seed(0)
    means = []
    for data in splits:
        losses = []
        for _ in range(n_batches):
            x, y = batch(data, context, gen, device)
            with autocast():
                losses.append(model(x, y)[1].item())
        means.append(sum(losses) / len(losses))
    model.train()
    return means


def save_checkpoint(model, path, step, tokenizer, replace):
    """Part 3's checkpoint {"model", "config", "step"}, and the record of the tokenizer beside the config,
    where Part 3's loader (Config(**ckpt["config"])) never looks."""
    config = {k: v for k, v in vars(model.cfg).items() if k != "n_kv_heads"}  # Part 3's six fields
    with atomic_write(path, replace) as f:
        torch.save({"model": model.state_dict(), "config": config, "step": step, "tokenizer": tokenizer}, f)


def read_resume(name, device):
    """What a cut-short run left, or a one-line error naming the file. The CSV log keeps only
    the rows up to the resume file's step: a run killed between writing a row and writing the
    resume file logged a step that the resumed run will do again."""
    path, log = f"{name}.resume.pt", f"{name}.csv"
    if not os.path.lexists(path):
        instead = "start without --resume"
        if os.path.lexists(f"{name}.pt"):
            instead = f"to train again, pass --force instead of --resume to replace {name}.pt, or --out NAME"
        raise ValueError(f"--resume: there is no cut-short run to go on from ({path!r} not found; a run that "
                         f"finishes removes it); {instead}")
    try:  # torch checks no checksum (a flipped bit would load), and a compressed entry could inflate to any size
        with zipfile.ZipFile(path) as archive:
            if any(entry.compress_type != zipfile.ZIP_STORED for entry in archive.infolist()):
                raise ValueError("an entry is compressed, which torch.save never does")
            if archive.testzip():
                raise ValueError("an entry fails its checksum")
        state = torch.load(path, map_location=device, weights_only=True)
        with open(log, newline="") as f:
            rows = list(csv.reader(f))[1:]
    except Exception as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ValueError(f"--resume: {path!r} or its log cannot be read ({reason}); "
                         "start again without --resume") from None
    missing = [k for k in RESUME_KINDS if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(f"--resume: {path!r} lacks {missing[0]!r} (an older train.py's, or not a resume file); "
                         "start again without --resume")
    for key, (kind, ok) in RESUME_KINDS.items():
        if not ok(state[key]):
            raise ValueError(f"--resume: {path!r} holds {key!r} = {repr(state[key])[:40]}, not {kind}; "
                             "start again without --resume")
    if not all(row and row[0].isdigit() for row in rows):
        raise ValueError(f"--resume: {log!r} has a row that does not start with a step; start again without --resume")
    return state, [row for row in rows if int(row[0]) <= state["step"]]


def check_same_run(here, then, args):
    """Refuse a resume whose corpus, tokenizer or settings are not the run's own, naming the first difference."""
    for flag, value in here.items():
        if then.get(flag) == value:
            continue
        if flag in ("--corpus", "--tokenizer"):
            path = args.corpus if flag == "--corpus" else args.tokenizer
            raise ValueError(f"--resume: {flag} {path!r} is not the file the run being resumed used (its sha256 "
                             f"differs); pass that file, or start again without --resume")
        raise ValueError(f"--resume: {flag} is {value} here but the run being resumed used {then.get(flag)}; "
                         "pass the same, or start again without --resume")


def random_states(device):
    """Where dropout draws from, and the resume file's key for each."""
    return [(torch, "rng")] + ([(torch.cuda, "cuda_rng")] if device.type == "cuda" else [])


def check_loss(loss, what, step):
    if not math.isfinite(loss):
        raise ValueError(f"{what} is {loss} at step {step}, so the run stops there; try a smaller --lr")


def show_progress(done, total, note=""):
    """Step `done` of `total` on one stderr line, redrawn in a terminal (nowhere else); done == total clears it."""
    if sys.stderr.isatty():
        line = f"step {done:,}/{total:,}, {note}" if done < total else ""
        print(f"\r{line[:78]:<79}\r", end="", file=sys.stderr, flush=True)


def log_line(text):
    """A plain line on stderr; in a terminal it overwrites the progress line."""
    print(f"{text:<79}" if sys.stderr.isatty() else text, file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(prog="python -m series.train", description="Train the Part 3 GPT on a text corpus.")
    ap.add_argument("--corpus", required=True, help="UTF-8 text file")
    ap.add_argument("--tokenizer", default="tokenizer.json")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default="holmes", help="writes NAME.pt, NAME.csv, NAME.resume.pt (removed when done)")
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-batches", type=int, default=20)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast on the CPU too (CUDA always uses it)")
    ap.add_argument("--resume", action="store_true", help="go on from NAME.resume.pt, with the same arguments")
    ap.add_argument("--force", action="store_true", help="replace an existing NAME.pt, NAME.csv and NAME.resume.pt")
    args = ap.parse_args()
    if min(args.steps, args.eval_every, args.eval_batches) < 1:
        ap.error("--steps, --eval-every and --eval-batches must be at least 1")
    if not (math.isfinite(args.lr) and args.lr > 0):
        ap.error(f"--lr must be a finite number above 0, got {args.lr}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA GPU here; use cpu")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` unwinds like Ctrl-C, removing temporary files
    try:
        train(args)
    except (ValueError, OSError) as e:  # what the user gave: an argument, a file, a folder
        sys.exit(f"{ap.prog}: error: {e}")
    except KeyboardInterrupt:
        sys.exit(f"{ap.prog}: interrupted; nothing half-written was left behind")


def train(args):
    device = torch.device(args.device)
    name = args.out.removesuffix(".pt")
    resume_file = f"{name}.resume.pt"
    check_outputs(name, args.force, args.resume, [args.corpus, args.tokenizer])
    use_bf16 = device.type == "cuda" or args.bf16

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16)

    cfg = Config()
    text = read_corpus(args.corpus, "pass --corpus PATH to a UTF-8 text file")
    tokenizer = BPE.load(args.tokenizer)
    if tokenizer.vocab_size != cfg.vocab_size:  # a smaller one too: every script refuses such a pair later
        raise ValueError(f"tokenizer {args.tokenizer!r} has {tokenizer.vocab_size:,} tokens but the model's "
                         f"vocabulary is {cfg.vocab_size:,}; pass a tokenizer trained with --vocab {cfg.vocab_size}")
    corpus_sha, record = hashlib.sha256(text.encode()).hexdigest(), tokenizer.record()
    run = {"--corpus": corpus_sha, "--tokenizer": record["sha256"], "--lr": args.lr, "--steps": args.steps,
           "--eval-every": args.eval_every, "--eval-batches": args.eval_batches, "--bf16": args.bf16,
           "--device": str(device), "--out": name}
    resumed = read_resume(name, device) if args.resume else None
    if resumed:
        check_same_run(run, resumed[0]["run"], args)
    needed = 10 * (cfg.context + 2)  # for the last 10% to hold one validation window of context + 1 tokens
    if len(text.encode()) < needed:  # a token is at least a byte: refused before anything is tokenized or cached
        too_few(args.corpus, f"{len(text.encode()):,} bytes", needed)
    ids = load_ids(text, tokenizer, cache_path(corpus_sha, record["sha256"]), args.corpus, needed)
    ids = torch.from_numpy(ids.astype(np.int64))
    split = int(0.9 * len(ids))
    train_ids, val_ids = ids[:split], ids[split:]

    torch.manual_seed(1337)
    model = GPT(cfg).to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(1337)
    start, best_val, elapsed = 0, float("inf"), 0.0

    rows = []
    replace = args.force or args.resume  # after the first evaluation, also the files this run wrote itself
    if resumed:
        state, rows = resumed
        try:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            gen.set_state(state["generator"])
            for rng, key in random_states(device):
                rng.set_rng_state(state[key].cpu())
        except Exception as e:
            raise ValueError(f"--resume: {resume_file!r} does not fit this run ({type(e).__name__})") from None
        # the optimizer loads moments of any shape; the first step that used them would fail
        if any(moment.shape != p.shape for p, kept in opt.state.items()
               for moment in (kept.get("exp_avg"), kept.get("exp_avg_sq")) if moment is not None):
            raise ValueError(f"--resume: {resume_file!r} does not fit this run (its optimizer's moments are not "
                             "shaped as the weights); start again without --resume")
        start, best_val, elapsed = state["step"], state["best_val"], state["elapsed"]
        print(f"resuming at step {start} (best val {best_val:.3f})", file=sys.stderr)

    t0, tokens = time.time(), 0
    try:
        for step in range(start, args.steps):
            done = step + 1
            for g in opt.param_groups:
                g["lr"] = lr_at(step, args.steps, args.lr)
            x, y = batch(train_ids, cfg.context, gen, device)
            with autocast():
                _, loss = model(x, y)
            check_loss(loss.item(), "the loss", done)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            tokens += x.numel()

            tok_s = tokens / (time.time() - t0)
            eta = (time.time() - t0) / (done - start) * (args.steps - done)
            show_progress(done, args.steps, f"loss {loss.item():.3f}, {tok_s:,.0f} tok/s, ETA {eta:,.0f}s")
            if done % args.eval_every == 0 or done == args.steps:
                train_loss, val_loss = evaluate(model, (train_ids, val_ids), cfg.context, args.eval_batches, device,
                                                autocast)
                check_loss(train_loss, "the evaluated train loss", done)
                check_loss(val_loss, "the val loss", done)
                total_time = elapsed + time.time() - t0
                rows.append([done, f"{train_loss:.4f}", f"{val_loss:.4f}", f"{tok_s:.0f}", f"{total_time:.1f}"])
                with atomic_write(f"{name}.csv", replace, "w", newline="") as f:  # the whole log, each time
                    csv.writer(f).writerows([COLUMNS, *rows])
                if val_loss < best_val:
                    best_val = val_loss
                    save_checkpoint(model, f"{name}.pt", done, record, replace)
                with atomic_write(resume_file, replace) as f:
                    torch.save({"run": run, "model": model.state_dict(), "optimizer": opt.state_dict(),
                                "generator": gen.get_state(),
                                **{key: rng.get_rng_state() for rng, key in random_states(device)},
                                "step": done, "best_val": best_val, "elapsed": total_time}, f)
                replace = True
                log_line(f"step {done}: train {train_loss:.3f}  val {val_loss:.3f}  {tok_s:,.0f} tok/s  "
                         f"{total_time:.0f}s")
    finally:  # clears a drawn progress line, so that an error or the end line starts a line of its own
        show_progress(args.steps, args.steps)
    # every loss was finite and the last step was evaluated: NAME.pt holds the best, and nothing is left to resume
    os.remove(resume_file)
    print(f"best val loss {best_val:.3f}; checkpoint {name}.pt, log {name}.csv", file=sys.stderr)


if __name__ == "__main__":
    main()
