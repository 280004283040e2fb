"""How the engines time anything: bench.py's way (a warm-up, then the functions take turns, one run each a
round, so a neighbour's load falls on all alike; a figure is the median of its runs), with what the engines'
tables need beyond bench.timed_in_turns: a warm-up of a fn's own (a short run before long ones), a fn that
times itself (an engine in a process of its own returns its seconds) and a progress line.
"""
import time

from bench import median, sync
from engines.edge.cli import show_progress


def timings(fns, runs, device, warmups=None, label=""):
    """{name: [seconds of each run]} of each fn, as bench.timed_in_turns times them; warmed up with warmups[name]
    where given, and a fn that returns a float gives its own seconds."""
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
    """{name: (median, spread)} of each fn's runs (timings), the spread half their range over the median."""
    return {name: (median(ts), (max(ts) - min(ts)) / 2 / median(ts))
            for name, ts in timings(fns, runs, device, warmups, label).items()}
