"""How this repo times anything: one helper, timings(), for every table and every choice made by measuring.

Each function is warmed up, then they take turns, one run each a round, so a neighbour's load
on a shared machine falls on all alike and their ratios stay fair; a figure is the median of
its runs, with its spread (half the range, as a share of the median).
"""
import time

import torch

from engines.edge.cli import show_progress


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
    """{name: [seconds of each run]} of each fn, warmed up once (with warmups[name] if given), then in turns;
    a fn that times itself (an engine in a process of its own) returns its own seconds instead."""
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
