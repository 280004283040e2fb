"""Part 3's training recipe, to make the checkpoint every other script uses.

    python train.py --corpus PATH [--steps 1500] [--out holmes] [--device cpu|cuda] [--resume | --force]

The corpus is tokenized once (the ids are cached under data/). Batches of
32 x 256 random windows from the first 90%; AdamW with warmup and cosine
decay; every 250 steps the mean loss of 20 train and 20 val batches goes to
NAME.csv and the best-val model to NAME.pt, in Part 3's checkpoint format.
NAME.resume.pt holds what a cut-short run needs to go on with --resume.
"""
import csv
import hashlib
import math
import os
import sys
import time

import numpy as np
import torch

from bpe import BPE
from cli import Parser, atomic_write, check_output, device_from, run_cli
from model import GPT, Config, save_checkpoint

BATCH = 32


def load_ids(corpus, tokenizer_path):
    """The corpus as uint16 ids, cached in data/ by the hash of corpus and tokenizer."""
    try:
        with open(corpus, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"corpus {corpus} not found; pass --corpus PATH to a UTF-8 text file") from None
    tokenizer = BPE.load(tokenizer_path)
    with open(tokenizer_path, "rb") as f:
        key = hashlib.sha256(raw + f.read()).hexdigest()[:16]
    cache = os.path.join("data", f"ids-{key}.npy")
    if os.path.exists(cache):
        return np.load(cache)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"corpus {corpus} is not UTF-8 ({e.reason} at byte {e.start})") from None
    t0 = time.time()
    ids = np.array(tokenizer.encode(text), dtype=np.uint16)
    print(f"tokenized {len(raw):,} bytes into {len(ids):,} tokens in {time.time() - t0:.1f}s", file=sys.stderr)
    os.makedirs("data", exist_ok=True)
    with atomic_write(cache) as f:
        np.save(f, ids)
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


def write_csv(path, rows):
    """The whole log, through a temporary file and a rename: a cut write leaves the old log whole."""
    with atomic_write(path, "w", newline="") as f:
        csv.writer(f).writerows([["step", "train_loss", "val_loss", "tokens_per_sec", "elapsed_sec"], *rows])


def read_resume(path, device):
    """What a cut-short run left, or a one-line error naming the file."""
    if not os.path.exists(path):
        raise ValueError(f"--resume: {path} not found; start without --resume")
    try:
        state = torch.load(path, map_location=device, weights_only=True)
        with open(path.replace(".resume.pt", ".csv"), newline="") as f:
            rows = list(csv.reader(f))[1:]
        missing = [k for k in ("model", "optimizer", "generator", "step", "best_val", "elapsed") if k not in state]
    except Exception as e:
        raise ValueError(f"--resume: {path} or its CSV log cannot be read ({type(e).__name__}); "
                         "start again without --resume") from None
    if missing:
        raise ValueError(f"--resume: {path} lacks {missing[0]!r}; start again without --resume")
    return state, rows


def random_states(device):
    """Where dropout draws from, and the resume file's key for each."""
    return [(torch, "rng")] + ([(torch.cuda, "cuda_rng")] if device.type == "cuda" else [])


def main():
    ap = Parser(description="Train the Part 3 GPT on a text corpus.")
    ap.add_argument("--corpus", required=True, help="UTF-8 text file")
    ap.add_argument("--tokenizer", default="tokenizer.json")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--out", default="holmes", help="writes NAME.pt, NAME.csv, NAME.resume.pt")
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-batches", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast on the CPU too (CUDA always uses it)")
    ap.add_argument("--resume", action="store_true", help="go on from NAME.resume.pt")
    ap.add_argument("--force", action="store_true", help="replace an existing NAME.pt and NAME.csv")
    args = ap.parse_args()
    for flag in ("steps", "eval_every", "eval_batches"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    device = device_from(args.device)
    name = args.out.removesuffix(".pt")
    if not args.resume:
        for path in (f"{name}.pt", f"{name}.csv"):
            check_output(path, args.force, "--force (or --resume to go on from it)")
    resumed = read_resume(f"{name}.resume.pt", device) if args.resume else None
    use_bf16 = device.type == "cuda" or args.bf16

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16)

    cfg = Config()
    ids = torch.from_numpy(load_ids(args.corpus, args.tokenizer).astype(np.int64))
    if len(ids) < 10 * (cfg.context + 2):
        raise ValueError(f"corpus {args.corpus} gives {len(ids):,} tokens; at least {10 * (cfg.context + 2):,} are "
                         f"needed for the last 10% to hold one {cfg.context + 1}-token validation window")
    if ids.max() >= cfg.vocab_size:
        raise ValueError(f"tokenizer makes id {ids.max().item()} but the model's vocabulary is {cfg.vocab_size}")
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
    if resumed:
        state, rows = resumed
        try:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            gen.set_state(state["generator"])
        except Exception as e:
            raise ValueError(f"--resume: {name}.resume.pt does not fit this run ({type(e).__name__})") from None
        for rng, key in random_states(device):
            if key in state:  # dropout's draws; resume files from before they were kept go on without them
                rng.set_rng_state(state[key].cpu())
        start, best_val, elapsed = state["step"], state["best_val"], state["elapsed"]
        print(f"resuming at step {start} (best val {best_val:.3f})", file=sys.stderr)

    t0, tokens = time.time(), 0
    for step in range(start, args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr)
        x, y = batch(train_ids, cfg.context, gen, device)
        with autocast():
            _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens += x.numel()

        done = step + 1
        run_time = time.time() - t0
        tok_s = tokens / run_time
        eta = (args.steps - done) * x.numel() / tok_s
        print(f"\rstep {done}/{args.steps}  loss {loss.item():.3f}  {tok_s:,.0f} tok/s  ETA {eta / 60:.1f} min ",
              end="", file=sys.stderr)
        if done % args.eval_every == 0 or done == args.steps:
            splits = (train_ids, val_ids)
            train_loss, val_loss = evaluate(model, splits, cfg.context, args.eval_batches, device, autocast)
            total_time = elapsed + time.time() - t0
            print(f"\rstep {done}: train {train_loss:.3f}  val {val_loss:.3f}  {tok_s:,.0f} tok/s"
                  f"  {total_time:.0f}s" + " " * 20, file=sys.stderr)
            rows.append([done, f"{train_loss:.4f}", f"{val_loss:.4f}", f"{tok_s:.0f}", f"{total_time:.1f}"])
            write_csv(f"{name}.csv", rows)
            if val_loss < best_val:
                best_val = val_loss
                save_checkpoint(model, f"{name}.pt", done)
            with atomic_write(f"{name}.resume.pt") as f:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "generator": gen.get_state(),
                            **{key: rng.get_rng_state() for rng, key in random_states(device)},
                            "step": done, "best_val": best_val, "elapsed": total_time}, f)
    print(f"best val loss {best_val:.3f}; checkpoint {name}.pt, log {name}.csv", file=sys.stderr)


if __name__ == "__main__":
    run_cli(main)
