"""Part 3's training recipe, to make the checkpoint every other script uses.

    python -m series.train --corpus PATH [--steps 1500] [--out holmes] [--device cpu|cuda] [--resume | --force]

The corpus is tokenized once (the ids are cached under data/). Batches of
32 x 256 random windows from the first 90%; AdamW with warmup and cosine
decay; every 250 steps the mean loss of 20 train and 20 val batches goes to
NAME.csv and the best-val model to NAME.pt, in Part 3's checkpoint format
plus a record of the tokenizer it was trained with. NAME.resume.pt holds
what a cut-short run needs to go on with --resume, and which run it is: a
resume with another corpus, tokenizer or setting is refused. A run that
finishes removes it. A loss that is not finite stops the run.
"""
import csv
import hashlib
import math
import os
import sys
import time

from engines.edge.cli import Parser, device_from, run_cli, show_progress
from engines.edge.files import atomic_write, check_input, check_output, shown
from engines.edge.errors import BadPath, BadValue

import numpy as np
import torch

from bpe import BPE, read_corpus
from engines.edge.checkpoint import check_archive, save_checkpoint
from model import GPT, Config

BATCH = 32
CACHE_DIR = "data"
MAX_RESUME_BYTES = 2**30  # Part 3's model with AdamW's two moments takes about 70 MB


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


def cache_path(corpus_sha, tokenizer_sha):
    """data/ids-KEY.npy for this corpus and these merges; if it is not there yet, its folder is
    made and checked writable, so a run never tokenizes for nothing."""
    key = hashlib.sha256(f"{corpus_sha} {tokenizer_sha}".encode()).hexdigest()[:16]
    path = os.path.join(CACHE_DIR, f"ids-{key}.npy")
    if os.path.isfile(path):
        return path
    if os.path.lexists(CACHE_DIR) and not os.path.isdir(CACHE_DIR):
        raise BadValue(f"{CACHE_DIR} is not a folder, but train.py caches token ids in {CACHE_DIR}/; move it away")
    try:
        os.makedirs(CACHE_DIR, exist_ok=True)
    except OSError as e:
        raise BadPath(f"cannot create the id cache folder {CACHE_DIR}/ ({e.strerror}); "
                      "run train.py in a folder it may write") from None
    return check_output(path, force=True)


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
    with atomic_write(cache, force=True) as f:  # what may stand there is the same ids, cached by another run
        np.save(f, ids)
    print(f"tokenized {len(text.encode()):,} bytes into {len(ids):,} tokens in {time.time() - t0:.1f}s",
          file=sys.stderr)
    return ids


def too_few(corpus, size, needed):
    raise BadValue(f"corpus {shown(corpus)} gives {size}; at least {needed:,} tokens are needed for the last 10% to "
                   "hold one validation window; give a longer text")


def read_ids(cache, vocab_size):
    """The cached ids, or a one-line error naming the cache file: it is only a copy, so the way on is to remove it."""
    way_on = "remove it and train.py tokenizes the corpus again"
    try:
        ids = np.load(cache, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise BadValue(f"the token id cache {shown(cache)} cannot be read ({e}); {way_on}") from None
    if ids.dtype != np.uint16 or ids.ndim != 1:
        raise BadValue(f"the token id cache {shown(cache)} holds {ids.dtype} of shape {ids.shape}, not a row "
                         f"of uint16 ids; {way_on}")
    if len(ids) and int(ids.max()) >= vocab_size:
        raise BadValue(f"the token id cache {shown(cache)} holds id {int(ids.max())}, outside the tokenizer's "
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


def write_csv(path, rows, force):
    """The whole log, through a temporary file and a rename: a cut write leaves the old log whole."""
    with atomic_write(path, "w", force=force, newline="") as f:
        csv.writer(f).writerows([["step", "train_loss", "val_loss", "tokens_per_sec", "elapsed_sec"], *rows])


def read_resume(name, device):
    """What a cut-short run left, or a one-line error naming the file. The CSV log keeps only
    the rows up to the resume file's step: a run killed between writing a row and writing the
    resume file logged a step that the resumed run will do again."""
    path, log = f"{name}.resume.pt", f"{name}.csv"
    if not os.path.lexists(path):
        instead = "start without --resume"
        if os.path.lexists(f"{name}.pt"):
            instead = f"to train again, pass --force instead of --resume to replace {name}.pt, or --out NAME"
        raise BadValue(f"--resume: there is no cut-short run to go on from ({shown(path)} not found; a run that "
                         f"finishes removes it); {instead}")
    for p in (path, log):
        check_input(p, "--resume:", MAX_RESUME_BYTES, "start without --resume")
    try:
        check_archive(path)  # its checksums, and no compressed entry that could inflate to any size
    except ValueError as e:
        raise BadValue(f"--resume: {e}; start again without --resume") from None
    try:
        state = torch.load(path, map_location=device, weights_only=True)
        with open(log, newline="") as f:
            rows = list(csv.reader(f))[1:]
    except Exception as e:
        raise BadValue(f"--resume: {shown(path)} or its CSV log cannot be read ({type(e).__name__}); "
                         "start again without --resume") from None
    missing = [k for k in RESUME_KINDS if not isinstance(state, dict) or k not in state]
    if missing:
        raise BadValue(f"--resume: {shown(path)} lacks {missing[0]!r} (an older train.py's, or not a resume file); "
                         "start again without --resume")
    check_resume_values(state, path)
    if not all(row and row[0].isdigit() for row in rows):
        raise BadValue(f"--resume: {log} has a row that does not start with a step; start again without --resume")
    return state, [row for row in rows if int(row[0]) <= state["step"]]


def check_resume_values(state, path):
    """Each value a resume file holds is of the kind train.py wrote, named where it is not."""
    for key, (kind, ok) in RESUME_KINDS.items():
        if not ok(state[key]):
            raise BadValue(f"--resume: {shown(path)} holds {key!r} = {repr(state[key])[:40]}, not {kind}; "
                             "start again without --resume")


def check_outputs(name, force, resume, inputs):
    """NAME.pt, NAME.csv and NAME.resume.pt can be written (and are none of the run's inputs); one that
    exists is replaced only with --force or --resume, and the refusal names every way on."""
    paths = [check_output(path, force=True, inputs=inputs) for path in (f"{name}.pt", f"{name}.csv", f"{name}.resume.pt")]
    existing = next((path for path in paths if os.path.lexists(path)), None)
    if existing and not (force or resume):
        cut = f", or --resume to go on from the cut-short run in {paths[2]}" if os.path.lexists(paths[2]) else ""
        raise BadValue(f"{existing} already exists; pass --force to replace it, or --out NAME for a new run{cut}")


def check_same_run(here, then, args):
    """Refuse a resume whose corpus, tokenizer or settings are not the run's own, naming the first difference."""
    for flag, value in here.items():
        if then.get(flag) == value:
            continue
        if flag in ("--corpus", "--tokenizer"):
            path = args.corpus if flag == "--corpus" else args.tokenizer
            raise BadValue(f"--resume: {flag} {shown(path)} is not the file the run being resumed used (its sha256 "
                             f"differs); pass that file, or start again without --resume")
        raise BadValue(f"--resume: {flag} is {value} here but the run being resumed used {then.get(flag)}; "
                         "pass the same, or start again without --resume")


def random_states(device):
    """Where dropout draws from, and the resume file's key for each."""
    return [(torch, "rng")] + ([(torch.cuda, "cuda_rng")] if device.type == "cuda" else [])


def check_loss(loss, what, step):
    if not math.isfinite(loss):
        raise BadValue(f"{what} is {loss} at step {step}, so the run stops there; try a smaller --lr")


def log_line(text):
    """A plain line on stderr; in a terminal it first overwrites the progress line."""
    print(f"\r{text:<79}" if sys.stderr.isatty() else text, file=sys.stderr)


def main():
    ap = Parser(description="Train the Part 3 GPT on a text corpus.")
    ap.add_argument("--corpus", required=True, help="UTF-8 text file")
    ap.add_argument("--tokenizer", default="tokenizer.json")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default="holmes", help="writes NAME.pt, NAME.csv, NAME.resume.pt (removed when done)")
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-batches", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast on the CPU too (CUDA always uses it)")
    ap.add_argument("--resume", action="store_true", help="go on from NAME.resume.pt, with the same arguments")
    ap.add_argument("--force", action="store_true", help="replace an existing NAME.pt, NAME.csv and NAME.resume.pt")
    args = ap.parse_args()
    for flag in ("steps", "eval_every", "eval_batches"):
        if getattr(args, flag) < 1:
            raise BadValue(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise BadValue(f"--lr must be a finite number above 0, got {args.lr}")
    device = device_from(args.device)
    name = args.out.removesuffix(".pt")
    if not os.path.basename(name):
        raise BadValue(f"--out {args.out!r} names no run; give a name like holmes or runs/holmes")
    check_outputs(name, args.force, args.resume, inputs=[args.corpus, args.tokenizer])
    use_bf16 = device.type == "cuda" or args.bf16

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16)

    cfg = Config()
    text = read_corpus(args.corpus, "pass --corpus PATH to a UTF-8 text file")
    tokenizer = BPE.load(args.tokenizer)
    if tokenizer.vocab_size != cfg.vocab_size:  # a smaller one too: every script refuses such a pair later
        raise BadValue(f"tokenizer {shown(args.tokenizer)} has {tokenizer.vocab_size:,} tokens but the model's "
                         f"vocabulary is {cfg.vocab_size:,}; pass a tokenizer trained with --vocab {cfg.vocab_size}")
    corpus_sha, record = hashlib.sha256(text.encode()).hexdigest(), tokenizer.record()
    tokenizer_sha = record["sha256"]
    run = {"--corpus": corpus_sha, "--tokenizer": tokenizer_sha, "--lr": args.lr, "--steps": args.steps,
           "--eval-every": args.eval_every, "--eval-batches": args.eval_batches, "--bf16": args.bf16,
           "--device": str(device), "--out": name}
    resumed = read_resume(name, device) if args.resume else None
    if resumed:
        check_same_run(run, resumed[0]["run"], args)
    needed = 10 * (cfg.context + 2)  # for the last 10% to hold one validation window of context + 1 tokens
    if len(text.encode()) < needed:  # a token is at least a byte: refused before anything is tokenized or cached
        too_few(args.corpus, f"{len(text.encode()):,} bytes", needed)
    ids = load_ids(text, tokenizer, cache_path(corpus_sha, tokenizer_sha), args.corpus, needed)
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
            raise BadValue(f"--resume: {name}.resume.pt does not fit this run ({type(e).__name__})") from None
        # the optimizer loads moments of any shape; the first step that used them would fail
        if any(moment.shape != p.shape for p, kept in opt.state.items()
               for moment in (kept.get("exp_avg"), kept.get("exp_avg_sq")) if moment is not None):
            raise BadValue(f"--resume: {name}.resume.pt does not fit this run (its optimizer's moments are not "
                             "shaped as the weights); start again without --resume")
        start, best_val, elapsed = state["step"], state["best_val"], state["elapsed"]
        print(f"resuming at step {start} (best val {best_val:.3f})", file=sys.stderr)

    t0, tokens = time.time(), 0
    label = f"steps after {start:,}" if start else "step"
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
            show_progress(label, done - start, args.steps - start, t0,
                          note=f"loss {loss.item():.3f}, {tok_s:,.0f} tok/s")
            if done % args.eval_every == 0 or done == args.steps:
                splits = (train_ids, val_ids)
                train_loss, val_loss = evaluate(model, splits, cfg.context, args.eval_batches, device, autocast)
                check_loss(train_loss, "the evaluated train loss", done)
                check_loss(val_loss, "the val loss", done)
                total_time = elapsed + time.time() - t0
                rows.append([done, f"{train_loss:.4f}", f"{val_loss:.4f}", f"{tok_s:.0f}", f"{total_time:.1f}"])
                write_csv(f"{name}.csv", rows, replace)
                if val_loss < best_val:
                    best_val = val_loss
                    save_checkpoint(model, f"{name}.pt", done, tokenizer=record, force=replace)
                with atomic_write(f"{name}.resume.pt", force=replace) as f:
                    torch.save({"run": run, "model": model.state_dict(), "optimizer": opt.state_dict(),
                                "generator": gen.get_state(),
                                **{key: rng.get_rng_state() for rng, key in random_states(device)},
                                "step": done, "best_val": best_val, "elapsed": total_time}, f)
                replace = True
                log_line(f"step {done}: train {train_loss:.3f}  val {val_loss:.3f}  {tok_s:,.0f} tok/s  "
                         f"{total_time:.0f}s")
    finally:  # clears a drawn progress line, so that an error or the end line starts a line of its own
        show_progress(label, args.steps - start, args.steps - start, t0)
    # every loss was finite and the last step was evaluated, so NAME.pt holds the best of them, and
    # nothing is left to resume
    os.remove(f"{name}.resume.pt")
    print(f"best val loss {best_val:.3f}; checkpoint {name}.pt, log {name}.csv", file=sys.stderr)


if __name__ == "__main__":
    run_cli(main)
