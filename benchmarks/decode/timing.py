"""The decode benchmark's clock and timers: wall or one thread's CPU time, repetitions within a budget, CUDA graphs,
the device's copy bandwidth."""

from __future__ import annotations

import statistics
import time

import torch


# The step clock: wall time by default; with `--clock cpu`, the CPU time of this (only) thread, which leaves out the
# time the scheduler gives to other jobs on a shared machine (memory stalls still count: they happen on the CPU).
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
_clock = time.perf_counter


def set_clock(name: str) -> None:
    """The step clock for what follows: `wall` or `cpu` (CLOCKS)."""
    global _clock
    _clock = CLOCKS[name]


def now() -> float:
    return _clock()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_samples(fn, device, reps: int) -> list[float]:
    """Seconds of each of `reps` calls (no warm-up)."""
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = now()
            fn()
            times.append(now() - t0)
    return times


def time_fn(fn, device, reps: int, warmup: int = 2) -> float:
    """Median seconds of `reps` calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    return statistics.median(time_samples(fn, device, reps))


def reps_for(seconds_guess: float, budget: float, lo: int = 3, hi: int = 50) -> int:
    return int(max(lo, min(hi, budget / max(seconds_guess, 1e-6))))


def copy_bandwidth(device, dtype) -> float:
    """Device copy bandwidth in bytes/s (read + write), from copying a 512 MiB (CPU: 256 MiB) buffer."""
    n = (512 if device.type == "cuda" else 256) * 2**20 // torch.tensor([], dtype=dtype).element_size()
    src = torch.empty(n, dtype=dtype, device=device).normal_()
    dst = torch.empty_like(src)
    seconds = time_fn(lambda: dst.copy_(src), device, reps=10)
    bw = 2 * src.numel() * src.element_size() / seconds
    del src, dst
    return bw


def captured(step, device):
    """`step` captured in a CUDA graph (warm-up on a side stream first): returns the graph's replay."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream(device).wait_stream(stream)
    sync(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def graph_seconds(calls, device, reps: int = 20) -> float:
    """Median GPU seconds per call: one CUDA graph runs every call of `calls` once (each on its own input set, so a
    set is cold in L2 when its turn comes), and the graph's replays are timed with events."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm-up outside the capture: compilation, autotuning, workspace allocation
        for call in calls:
            call()
    torch.cuda.current_stream(device).wait_stream(stream)
    sync(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    sync(device)
    seconds = statistics.median(time_samples(graph.replay, device, reps)) / len(calls)
    del graph
    return seconds
