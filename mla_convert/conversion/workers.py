"""Layers refined side by side in worker processes (`--refine-workers`).

On the source's calibration stream (`--calib-propagate source`, the default) a layer's refinement needs only its own
inputs and targets, never another converted layer, so several layers can train at once. On a CPU a refinement step at
a few hundred positions (`--refine-queries`) is too small to keep every thread of one process busy: single-threaded
processes, one per core, get more steps a second out of the same cores (measured: docs/decisions.md#refinement-workers).
Each worker is a spawned process (no fork of a process whose threads are running) that ignores Ctrl-C: the
conversion's own process handles the interrupt and stops them. Tensors travel through shared memory.
"""

from __future__ import annotations

import logging
import signal
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Callable

import torch

from mla_convert.errors import UserError

log = logging.getLogger(__name__)

AUTO_CPU_WORKERS = 2  # `--refine-workers auto` on a CPU with at least this many threads
AUTO_MIN_SECONDS = 120  # ... where the refinement is estimated to take at least this long in one process (a worker
# starts by importing torch and transformers)
# The layers' phase on 2 cores: its time in one process over its time with two single-threaded workers, for steps at
# chosen positions (`--refine-queries`) and at every position of a window (the estimate divides by it wherever
# workers run).
SPEEDUP = 1.2
SPEEDUP_WHOLE = 1.4
POLL_SECONDS = 0.5  # how long this process waits on its workers at a time


def speedup(queries: int) -> float:
    """What two workers divide the refinement's estimate by, for steps at `queries` positions (0: every position)."""
    return SPEEDUP if queries else SPEEDUP_WHOLE


def resolve_workers(requested: int | None, device: str, steps: int, propagate: str, layers: int,
                    seconds: float) -> int:
    """Processes refining layers at once: `requested` (at most one per layer), or (None, auto) AUTO_CPU_WORKERS on a
    CPU with that many threads where layers are refined on the source's stream and the refinement's estimate in one
    process (`seconds`) is at least AUTO_MIN_SECONDS, else 1 (this process, one layer at a time: on a GPU, where each
    layer is refined on the converted layers' outputs, and where starting workers would cost more than they save)."""
    if steps <= 0:
        return 1
    if requested is not None:
        return max(1, min(requested, layers))
    if not device.startswith("cpu") or propagate != "source" or torch.get_num_threads() < AUTO_CPU_WORKERS:
        return 1
    return min(AUTO_CPU_WORKERS, layers) if seconds >= AUTO_MIN_SECONDS else 1


def _start(threads: int, level: int) -> None:
    """A worker's set-up: its share of the threads, the conversion's log level; Ctrl-C is the parent's to handle."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    logging.basicConfig(level=level, format="%(message)s", force=True)
    for noisy in ("transformers", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def _refine(args: tuple):
    from mla_convert.conversion.stages import refined_layer

    return refined_layer(*args)


class RefinePool:
    """At most `workers` layers refining at once, each in a worker process with torch.get_num_threads() // workers
    threads; `done(i, result)` receives each layer's `stages.refined_layer` result in this process as it finishes.
    Used as a context manager: leaving it waits for every layer, or, on an error, stops the workers."""

    def __init__(self, workers: int, done: Callable[[int, tuple], None]):
        threads = max(1, torch.get_num_threads() // workers)
        context = torch.multiprocessing.get_context("spawn")
        self.pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_start,
                                        initargs=(threads, logging.getLogger().getEffectiveLevel()))
        self.workers, self.done, self.running = workers, done, {}
        log.info("refining %d layers at once, in worker processes of %d thread(s)", workers, threads)

    def submit(self, i: int, args: tuple) -> None:
        """Layer i's `refined_layer(*args)` on a worker, once one is free (finished layers handed to `done` first)."""
        while len(self.running) >= self.workers:
            self._collect(FIRST_COMPLETED)
        self.running[self.pool.submit(_refine, args)] = i

    def _collect(self, when: str) -> None:
        while True:  # in short waits: a Ctrl-C that the kernel hands to another thread reaches this one between them
            finished, pending = wait(self.running, timeout=POLL_SECONDS, return_when=when)
            if finished and (when == FIRST_COMPLETED or not pending):
                break
        for future in sorted(finished, key=self.running.get):
            i = self.running.pop(future)
            try:
                result = future.result()
            except BrokenProcessPool:
                raise UserError(f"a refinement worker died while refining layer {i} (out of memory?): convert again "
                                "to resume, with --refine-workers 1 to refine one layer at a time") from None
            self.done(i, result)

    def __enter__(self) -> RefinePool:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            if self.running:
                self._collect(ALL_COMPLETED)
            self.pool.shutdown()
            return
        for process in list(getattr(self.pool, "_processes", {}).values()):  # a worker would finish its layer first
            process.terminate()
        self.pool.shutdown(wait=True, cancel_futures=True)
