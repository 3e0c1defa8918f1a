"""Fine-tuning data: train sequences (a text packed, a self-text pool, or fresh self text sampled as the steps read it)
and held-out windows (through mla_convert.data), and the data order."""

from __future__ import annotations

from pathlib import Path

import torch

from mla_convert.errors import UserError
from mla_convert.conversion.selftext import STYLES, length_args
from mla_convert.training.recipe import FinetuneConfig
from mla_convert.training.models import teacher_spec


class DataOrder:
    """Which packed sequences a (step, micro-step, rank) reads: a pure function of the seed, so resume repeats it.

    Global position p = ((step * grad_accum + micro) * world + rank) * batch + i walks through a fresh seeded
    permutation of all sequences per epoch (epoch = p // N); an endless stream (N None) is read in order: sequence p.
    """

    def __init__(self, n_sequences: int | None, batch_size: int, grad_accum: int, world: int, seed: int):
        """n_sequences None: an endless stream of fresh sequences (FreshSequences), read in order, each once."""
        self.n, self.batch, self.accum, self.world, self.seed = n_sequences, batch_size, grad_accum, world, seed
        self._perms: dict[int, torch.Tensor] = {}

    def last(self, step: int) -> int:
        """The highest sequence index any process reads at optimizer step `step`."""
        return ((step * self.accum + self.accum - 1) * self.world + self.world - 1) * self.batch + self.batch - 1

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = torch.randperm(self.n, generator=gen)
        return self._perms[epoch]

    def indices(self, step: int, micro: int, rank: int) -> list[int]:
        start = ((step * self.accum + micro) * self.world + rank) * self.batch
        if self.n is None:
            return list(range(start, start + self.batch))
        return [int(self._perm(p // self.n)[p % self.n]) for p in range(start, start + self.batch)]


class FreshSequences:
    """data=self without a pool (data_tokens unset): training sequence k is tokens [k * seq_len, (k + 1) * seq_len)
    of the teacher's self-text stream (selftext.Stream), sampled when a step first needs it, so that no text is read
    twice however long the run. In a run of several processes the main one samples and writes the cache; the others
    read it back."""

    def __init__(self, stream, seq_len: int, is_main: bool = True):
        self.stream, self.seq_len, self.is_main = stream, seq_len, is_main

    def prepare(self, last: int, barrier=None) -> None:
        """Make sequences up to index `last` readable in every process (`barrier`: waits for all of them)."""
        reach(self.stream, (last + 1) * self.seq_len, self.is_main, barrier)

    def __getitem__(self, index) -> torch.Tensor:
        """Sequence `index` [seq_len], or sequences [len, seq_len] for a list of indices."""
        one = not isinstance(index, (list, tuple))
        rows = [index] if one else list(index)
        self.prepare(max(rows))
        t = self.seq_len
        out = torch.tensor([self.stream.tokens[k * t : (k + 1) * t] for k in rows], dtype=torch.long)
        return out[0] if one else out

    def close(self) -> None:
        self.stream.close()


def reach(stream, need: int, is_main: bool = True, barrier=None) -> None:
    """Make the first `need` tokens of a self-text stream readable in every process: the main one samples (and writes
    the cache), the others read it back. With `barrier` every process calls it whatever it holds (what the others hold
    is not known here), so that all of them meet there."""
    if is_main and len(stream.tokens) < need:
        stream.ensure(need)
        if barrier is not None:
            stream.flush()  # the other processes read the text from the cache file
    if barrier is not None:
        barrier()
        if not is_main and len(stream.tokens) < need:
            stream.reload()
    if len(stream.tokens) < need:
        raise UserError(f"the self-text cache {stream.path} holds fewer tokens than the main process sampled: every "
                        "process of a run must share one cache folder (MLA_CONVERT_CACHE)")


def _teacher_source(cfg: FinetuneConfig):
    """The source the teacher is, opened for sampling (data=self or self-doc)."""
    from mla_convert.sources import open_source

    spec = teacher_spec(cfg) if cfg.teacher is not None else None
    if spec is None:
        raise UserError(f"data={cfg.data} samples the training text from the teacher: set teacher (auto, or the "
                        "source)")
    return open_source(None if spec == "embedded" else spec)


def self_training_tokens(cfg: FinetuneConfig, world: int, device: str = "cpu") -> torch.Tensor:
    """data=self with a pool (data_tokens): a token stream sampled from the teacher (the source;
    mla_convert.conversion.selftext, cached) on `device`: the pool of data_tokens (fewer when the run's step budget
    needs fewer), then the held-out windows when eval_data is unset."""
    from mla_convert.conversion.selftext import self_tokens

    source = _teacher_source(cfg)
    need = cfg.data_tokens
    if cfg.max_steps is not None or cfg.max_tokens is not None:
        per_step = cfg.seq_len * cfg.batch_size * cfg.grad_accum * world
        need = min(need, cfg.max_steps * per_step if cfg.max_steps is not None else cfg.max_tokens)
    need += 0 if cfg.eval_data is not None else cfg.eval_windows * cfg.eval_seq_len
    stream = self_tokens(source, need + cfg.seq_len, cfg.seed, batch=cfg.sample_batch, device=device,
                         **length_args(cfg.data, cfg.seq_len))
    return stream[: need + cfg.seq_len]  # the pool, then the held-out tail


# The held-out windows of fresh self text come from their own seeded stream (seed + this): text neither the run nor
# the conversion (whose calibration text is the first samples of the run's own seed) ever trained on.
HELD_OUT_SEED_OFFSET = 1_000_000_007


def fresh_self_text(cfg: FinetuneConfig, device: str = "cpu", is_main: bool = True,
                    barrier=None) -> tuple[FreshSequences, torch.Tensor | None]:
    """data=self without a pool: (the training sequences, sampled as they are read; the held-out token ids, sampled
    here from a stream of their own seed, or None when eval_data is set)."""
    from mla_convert.conversion.selftext import Stream

    if cfg.max_tokens is None and cfg.max_steps is None and cfg.max_seconds is None:
        raise UserError(f"data={cfg.data} samples fresh text as long as the run lasts: bound it with max_seconds, "
                        "max_tokens or max_steps (or sample a pool once: data_tokens)")
    source = _teacher_source(cfg)
    train = FreshSequences(Stream(source, cfg.seed, batch=cfg.sample_batch, device=device,
                                  **length_args(cfg.data, cfg.seq_len)), cfg.seq_len, is_main)
    if cfg.eval_data is not None:
        return train, None
    held = cfg.eval_windows * cfg.eval_seq_len
    stream = Stream(source, cfg.seed + HELD_OUT_SEED_OFFSET, batch=cfg.sample_batch, device=device,
                    **length_args(cfg.data, cfg.eval_seq_len))
    reach(stream, held, is_main, barrier)
    stream.close()  # its sampler's copy of the source is not kept for the run
    return train, torch.tensor(stream.tokens[:held], dtype=torch.long)


def report_windows(cfg: FinetuneConfig, tokenizer) -> dict[str, torch.Tensor]:
    """report_data: {text name: its first report_windows windows of report_seq_len tokens [W, T]}, tokenized as
    `mla-convert eval` does; each text is refused if it shares lines with the training text."""
    from mla_convert import data
    from mla_convert.evaluate import eval_windows

    out: dict[str, torch.Tensor] = {}
    train_text = None if cfg.data in STYLES else data.load_text(cfg.data)
    for spec in [s.strip() for s in (cfg.report_data or "").split(",") if s.strip()]:
        if cfg.data not in STYLES and Path(spec).expanduser().resolve() == Path(cfg.data).expanduser().resolve():
            raise UserError(f"report_data names the training text {spec}: report on text the run does not train on")
        text = data.load_text(spec)
        if train_text is not None:
            data.check_disjoint(train_text, text, cfg.data, spec)
        name = Path(spec).stem if Path(spec).expanduser().is_file() else spec
        if name in out:
            raise UserError(f"report_data names two texts called {name}: give each text once")
        out[name] = eval_windows(data.tokenize(tokenizer, text), cfg.report_seq_len, cfg.report_windows)
    return out


def prepare_data(cfg: FinetuneConfig, tokenizer, world: int = 1, device: str = "cpu", is_main: bool = True,
                 barrier=None) -> tuple[torch.Tensor | FreshSequences, torch.Tensor]:
    """(train sequences [N, seq_len], or FreshSequences for data=self without a pool; eval windows [W, eval_seq_len]);
    never sharing text with each other."""
    from mla_convert import data

    if not cfg.allow_test_split and data.looks_like_test_split(cfg.data):
        raise UserError(f"training text {cfg.data} looks like a test split: train on other text "
                        "(or set allow_test_split=true if it really is not evaluation text)")
    fresh = None
    if cfg.data in STYLES and cfg.data_tokens is None:
        fresh, ids = fresh_self_text(cfg, device, is_main, barrier)  # ids: the held-out head (None with eval_data)
        text = ""
    elif cfg.data in STYLES:
        ids = self_training_tokens(cfg, world, device)
        text = tokenizer.decode(ids.tolist())
    else:
        text = data.load_text(cfg.data)
        ids = data.tokenize(tokenizer, text, data.TRAIN_CHUNK_LINES)  # [N]
    held = cfg.eval_windows * cfg.eval_seq_len
    if fresh is not None and cfg.eval_data is None:
        train_ids, eval_ids = None, ids  # disjoint: the held-out samples are of a seed of their own
    elif cfg.eval_data is None:
        if ids.numel() < held + cfg.seq_len:
            raise UserError(f"{cfg.data} has {ids.numel()} tokens: too few to hold out {held} for evaluation and "
                            f"train on sequences of {cfg.seq_len}; lower eval_windows or pass eval_data")
        train_ids, eval_ids = ids[:-held], ids[-held:]  # disjoint by construction: the tail is held out
    else:
        if Path(cfg.eval_data).expanduser().resolve() == Path(cfg.data).expanduser().resolve():
            raise UserError("eval_data is the training text: give held-out text, or leave eval_data unset")
        eval_text = data.load_text(cfg.eval_data)
        if fresh is None:
            data.check_disjoint(text, eval_text, cfg.data, cfg.eval_data)
        train_ids, eval_ids = ids, data.tokenize(tokenizer, eval_text, data.TRAIN_CHUNK_LINES)
    train = fresh if fresh is not None else data.pack(train_ids, cfg.seq_len)
    windows = data.pack(eval_ids, cfg.eval_seq_len)[: cfg.eval_windows]
    return train, windows
