"""How this repo times anything: one helper, timings(), for every table and every choice made by measuring.

Each function is warmed up, then they take turns, one run each a round, so a
neighbour's load on a shared machine falls on all of them alike and the ratios
between them stay fair; a figure is the median of its runs, with its spread
(half the range, as a share of the median). Beside it, what a figure is set
against: the memory read bandwidth measured here, the bytes a decode step must
read, and the machine it ran on.
"""
import platform
import time

from cli import free_memory, show_progress

import torch

from cached import CachedGPT
from checks import cache_bytes

PROMPT = 8  # the post's prompt length, in tokens
READ_BYTES = 2**30  # the tensor read_bandwidth sums: far past any last-level cache


def sync(device):
    """Wait for the GPU's queued work, so a timing covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median(xs):
    return sorted(xs)[len(xs) // 2]


def half_range(xs):
    """Half the range, as a share of the median."""
    return (max(xs) - min(xs)) / 2 / median(xs)


def timings(fns, runs, device, warmups=None, label=""):
    """{name: [seconds of each run]} of each fn's wall time; a fn that times itself (an engine in a
    process of its own) returns its own seconds instead.

    Each fn is warmed up once (with warmups[name] if given), then they take turns, one run each a
    round: on a shared machine a neighbour's load then falls on all of them alike, and the ratios
    between them, measured side by side, stay fair.
    """
    for name, fn in fns.items():
        (warmups or fns)[name]()
    times, started = {name: [] for name in fns}, time.time()
    for i in range(runs):
        for name, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            own = fn()
            sync(device)
            times[name].append(own if isinstance(own, float) else time.perf_counter() - t0)
        show_progress(f"  {label} rounds", i + 1, runs, started)
    return times


def measure(fns, runs, device, warmups=None, label=""):
    """{name: (median, spread)} of each fn's wall time over runs, timed in turns as timings() does."""
    return {name: (median(ts), half_range(ts)) for name, ts in timings(fns, runs, device, warmups, label).items()}


def read_bandwidth(device, nbytes=READ_BYTES, runs=5):
    """Bytes per second this machine reads from memory with torch's threads here: a float32 tensor of
    nbytes (at most a quarter of the memory available) summed, the median of `runs` after a warm-up."""
    available = free_memory(device)
    if available is not None:
        nbytes = min(nbytes, available // 4)
    # filled, not torch.empty: untouched pages all map the one zero page, and summing them reads no memory
    x = torch.ones(nbytes // 4, device=device)
    seconds = timings({"sum": x.sum}, runs, device, label="memory read:")["sum"]
    return x.nbytes / median(seconds)


def bytes_per_step(model, batch, n_tokens, cached=True, cache_dtype=None):
    """The bytes a step of a greedy generation of `batch` rows must read from memory, averaged over the
    n_tokens steps that make its tokens from a PROMPT-token prompt: over a step's time, the rate it reads
    at (gpt-fast counts the weights alone; nanochat's infer_bench the weights and the cache, as here).

    Every weight once, at its own dtype: a step reads them once for all its rows (parameters and
    buffers alike, as gpt-fast counts them). The embedding table only at the rows it looks up,
    unless the head reads it whole (tied, as here), when it counts once. Cached, each row's keys and
    values at the positions it attends to, in cache_dtype (default the embedding's, as KVCache keeps
    them): the step making token j attends min(PROMPT + j, context) (the prefill, j = 0, its
    prompt); a step that reads more than that (the compiled one reads the whole window behind a
    mask) is not credited for it. Uncached, a step recomputes its keys rather than reading them.
    """
    cfg, emb = model.cfg, model.emb.weight
    attended = [min(PROMPT + j, cfg.context) for j in range(n_tokens)]
    weights = sum(t.nbytes for t in {id(t): t for t in (*model.parameters(), *model.buffers())}.values())
    if not any(t is emb for t in (*model.head.parameters(), *model.head.buffers())):
        looked_up = batch if cached else batch * sum(attended) / n_tokens  # the uncached step feeds what it attends
        weights += looked_up * emb[0].nbytes - emb.nbytes
    if not cached:
        return weights
    per_position = cache_bytes(cfg, batch, 1, torch.finfo(cache_dtype or emb.dtype).bits // 8)
    return weights + per_position * sum(attended) / n_tokens


def put_bandwidth(row, key, step_bytes, bandwidth):
    """row[key + "_step_bytes"] and row[key + "_bandwidth_share"]: what a step of row[key] tok/s reads, and
    the rate it reads at (bytes a step x steps a second, tok/s over the batch) as a share of the bandwidth."""
    row[key + "_step_bytes"] = step_bytes
    row[key + "_bandwidth_share"] = step_bytes * row[key] / row["batch"] / bandwidth


def bandwidth_cells(row, keys, width):
    """Each key's MB a step reads and its share of the bandwidth, one cell of `width` each."""
    return " ".join(f"{row[k + '_step_bytes'] / 1e6:>{width - 8}.1f} MB {row[k + '_bandwidth_share']:>4.0%}"
                    for k in keys)


def machine(device):
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {"device": device.type, "threads": torch.get_num_threads(), "torch": torch.__version__, "cpu": cpu}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def untrained_model(device):
    """The speed tables' model: Part 3's, with seeded random weights (speed does not depend on training)."""
    torch.manual_seed(0)
    return CachedGPT().to(device).eval()


def timed_generation(engine, tokens, n, n_tokens, progress=None, **kwargs):
    """(time to first token, total time, rows) for Engine.generate run to the end."""
    device = engine.model.emb.weight.device
    sync(device)
    t0, started = time.perf_counter(), time.time()
    rows, ttft = [[] for _ in range(n)], None
    for step, (column, _) in enumerate(engine.generate(tokens, n, max_tokens=n_tokens, **kwargs), 1):
        ttft = ttft or time.perf_counter() - t0
        if progress:
            show_progress(progress, step, n_tokens, started)
        for row, token in zip(rows, column):
            row.append(token)
    sync(device)
    return ttft, time.perf_counter() - t0, rows
