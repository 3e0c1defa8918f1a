"""Training metrics (metrics.jsonl), the loss plot and peak memory."""

from __future__ import annotations

import json
import resource
from pathlib import Path

import torch

from mla_convert.writes import write_text_whole


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: allocated CUDA memory on a GPU, the resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


class Metrics:
    """metrics.jsonl on the main process; a resume drops the lines after the step it restarts from."""

    def __init__(self, path: Path, enabled: bool, resume_step: int):
        self.path, self.enabled = path, enabled
        if enabled:
            kept = []
            if resume_step > 0 and path.is_file():
                kept = [line for line in path.read_text().splitlines()
                        if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            write_text_whole(path, "".join(line + "\n" for line in kept))  # a full disk keeps the old lines

    def write(self, **record) -> None:
        """Append `record` as one line; a write that fails (a full disk) leaves the file as it was, no part line."""
        if not self.enabled:
            return
        with open(self.path, "ab", buffering=0) as f:
            end = f.seek(0, 2)
            try:
                rest = memoryview((json.dumps(record) + "\n").encode())
                while rest:
                    rest = rest[f.write(rest):]
            except OSError as e:
                f.truncate(end)
                raise OSError(e.errno, e.strerror, str(self.path)) from None

    def read(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def plot(records: list[dict], path: Path) -> None:
    """Training loss (and its CE / KL parts) and held-out perplexity against optimizer steps, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r.get("event") == "train"]
    evals = [r for r in records if r.get("event") == "eval"]
    reports = [r for r in evals if r.get("report")]
    fig, axes = plt.subplots(1, 3 if reports else 2, figsize=(15 if reports else 10, 4))
    ax1, ax2 = axes[0], axes[1]
    for key in ("loss", "ce", "kl"):
        points = [(r["step"], r[key]) for r in train if r.get(key) is not None]
        if points:
            ax1.plot(*zip(*points), label=key, linewidth=1)
    ax1.set_xlabel("optimizer step")
    ax1.set_ylabel("training loss (nats/token)")
    ax1.legend()
    if evals:
        ax2.plot([r["step"] for r in evals], [r["perplexity"] for r in evals], marker="o")
    ax2.set_xlabel("optimizer step")
    ax2.set_ylabel("held-out perplexity")
    if reports:
        for name in reports[0]["report"]:
            points = [(r["tokens"], r["report"][name]) for r in reports if name in r["report"]]
            axes[2].plot(*zip(*points), marker="o", label=name)
        axes[2].set_xlabel("training tokens")
        axes[2].set_ylabel("perplexity (report texts)")
        axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
