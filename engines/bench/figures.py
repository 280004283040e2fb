"""What a benchmark's figure is set against: the machine, its memory bandwidth, the bytes a step reads.

engines/bench's speed, peers and serving tables share them, and the model they time when no checkpoint
is given (untrained_model: speed does not depend on training).
"""
import platform

import torch

from cached import CachedGPT
from engines.edge.checks import cache_bytes
from engines.edge.cli import free_memory
from bench import median
from engines.edge.timing import timings

PROMPT = 8  # the post's prompt length, in tokens
READ_BYTES = 2**30  # the tensor read_bandwidth sums: far past any last-level cache


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
