"""Fine-tuning data: train sequences and held-out windows (through mla_convert.data), and the data order."""

from __future__ import annotations

from pathlib import Path

import torch

from mla_convert.errors import UserError
from mla_convert.conversion.selftext import SELF
from mla_convert.training.recipe import FinetuneConfig
from mla_convert.training.models import teacher_spec


class DataOrder:
    """Which packed sequences a (step, micro-step, rank) reads: a pure function of the seed, so resume repeats it.

    Global position p = ((step * grad_accum + micro) * world + rank) * batch + i walks through a fresh seeded
    permutation of all sequences per epoch (epoch = p // N).
    """

    def __init__(self, n_sequences: int, batch_size: int, grad_accum: int, world: int, seed: int):
        self.n, self.batch, self.accum, self.world, self.seed = n_sequences, batch_size, grad_accum, world, seed
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = torch.randperm(self.n, generator=gen)
        return self._perms[epoch]

    def indices(self, step: int, micro: int, rank: int) -> list[int]:
        start = ((step * self.accum + micro) * self.world + rank) * self.batch
        return [int(self._perm(p // self.n)[p % self.n]) for p in range(start, start + self.batch)]


def self_training_tokens(cfg: FinetuneConfig, world: int, device: str = "cpu") -> torch.Tensor:
    """data=self: a token stream sampled from the teacher (the source; mla_convert.conversion.selftext, cached) on `device`,
    long enough for the run's token budget (or data_tokens, when fewer) plus the held-out windows when eval_data is
    unset."""
    from mla_convert.sources import open_source
    from mla_convert.conversion.selftext import self_tokens

    spec = teacher_spec(cfg) if cfg.teacher is not None else None
    if spec is None:
        raise UserError("data=self samples the training text from the teacher: set teacher (auto, or the source)")
    if cfg.max_tokens is None and cfg.max_steps is None:
        raise UserError("data=self has no natural length: set max_tokens (or max_steps)")
    per_step = cfg.seq_len * cfg.batch_size * cfg.grad_accum * world
    need = cfg.max_steps * per_step if cfg.max_steps is not None else cfg.max_tokens
    if cfg.data_tokens is not None:  # a pool read again epoch after epoch (DataOrder)
        need = min(need, cfg.data_tokens)
    need += 0 if cfg.eval_data is not None else cfg.eval_windows * cfg.eval_seq_len
    stream = self_tokens(open_source(None if spec == "embedded" else spec), need + cfg.seq_len, cfg.seed,
                         batch=cfg.sample_batch, device=device)
    return stream if cfg.data_tokens is None else stream[: need + cfg.seq_len]  # the pool, then the held-out tail


def report_windows(cfg: FinetuneConfig, tokenizer) -> dict[str, torch.Tensor]:
    """report_data: {text name: its first report_windows windows of report_seq_len tokens [W, T]}, tokenized as
    `mla-convert eval` does; each text is refused if it shares lines with the training text."""
    from mla_convert import data
    from mla_convert.evaluate import eval_windows

    out: dict[str, torch.Tensor] = {}
    train_text = None if cfg.data == SELF else data.load_text(cfg.data)
    for spec in [s.strip() for s in (cfg.report_data or "").split(",") if s.strip()]:
        if cfg.data != SELF and Path(spec).expanduser().resolve() == Path(cfg.data).expanduser().resolve():
            raise UserError(f"report_data names the training text {spec}: report on text the run does not train on")
        text = data.load_text(spec)
        if train_text is not None:
            data.check_disjoint(train_text, text, cfg.data, spec)
        name = Path(spec).stem if Path(spec).expanduser().is_file() else spec
        if name in out:
            raise UserError(f"report_data names two texts called {name}: give each text once")
        out[name] = eval_windows(data.tokenize(tokenizer, text), cfg.report_seq_len, cfg.report_windows)
    return out


def prepare_data(cfg: FinetuneConfig, tokenizer, world: int = 1, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(train sequences [N, seq_len], eval windows [W, eval_seq_len]); never sharing text with each other."""
    from mla_convert import data

    if not cfg.allow_test_split and data.looks_like_test_split(cfg.data):
        raise UserError(f"training text {cfg.data} looks like a test split: train on other text "
                        "(or set allow_test_split=true if it really is not evaluation text)")
    if cfg.data == SELF:
        ids = self_training_tokens(cfg, world, device)
        text = tokenizer.decode(ids.tolist())
    else:
        text = data.load_text(cfg.data)
        ids = data.tokenize(tokenizer, text, data.TRAIN_CHUNK_LINES)  # [N]
    held = cfg.eval_windows * cfg.eval_seq_len
    if cfg.eval_data is None:
        if ids.numel() < held + cfg.seq_len:
            raise UserError(f"{cfg.data} has {ids.numel()} tokens: too few to hold out {held} for evaluation and "
                            f"train on sequences of {cfg.seq_len}; lower eval_windows or pass eval_data")
        train_ids, eval_ids = ids[:-held], ids[-held:]  # disjoint by construction: the tail is held out
    else:
        if Path(cfg.eval_data).expanduser().resolve() == Path(cfg.data).expanduser().resolve():
            raise UserError("eval_data is the training text: give held-out text, or leave eval_data unset")
        eval_text = data.load_text(cfg.eval_data)
        data.check_disjoint(text, eval_text, cfg.data, cfg.eval_data)
        train_ids, eval_ids = ids, data.tokenize(tokenizer, eval_text, data.TRAIN_CHUNK_LINES)
    train = data.pack(train_ids, cfg.seq_len)
    windows = data.pack(eval_ids, cfg.eval_seq_len)[: cfg.eval_windows]
    return train, windows
