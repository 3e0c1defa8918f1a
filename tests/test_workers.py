"""Layers refined in worker processes (`--refine-workers`, mla_convert.conversion.workers): the same conversion as one
layer at a time, where they are used by default, and what the plan says of them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from mla_convert.conversion import workers
from tiny import tiny_source


def _weights(folder) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    return tiny_source("llama-gqa", tmp_path_factory.mktemp("workers") / "src", seed=3, num_hidden_layers=4)


@pytest.fixture
def one_thread():
    """This process on one thread, as each of two workers on a 2-thread machine: the same order of float sums."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("scope", ["layer", "attention"])
def test_workers_write_the_bytes_one_process_writes(four_layers, convert_tiny, one_thread, caplog, scope):
    """Four layers refined by two workers of one thread each: the same weights, bit for bit, and the same records in
    layer order as the layers refined one after another in this process on one thread; the model stage after them
    sees the same layers."""
    lossy = dict(rank=4, rope_dims=4, calib_samples=16, calib_seq_len=64, refine_steps=40, refine_lr=3e-3,
                 refine_queries=16, refine_model_steps=2, refine_scope=scope)
    alone = convert_tiny(four_layers, refine_workers=1, **lossy)
    assert "layers at once" not in caplog.text
    with caplog.at_level("INFO", logger="mla_convert.conversion.workers"):
        shared = convert_tiny(four_layers, refine_workers=2, **lossy)
    assert "refining 2 layers at once, in worker processes of 1 thread(s)" in caplog.text
    a, b = _weights(alone), _weights(shared)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    plans = [json.loads((f / "provenance.json").read_text()) for f in (alone, shared)]
    assert [p["options"]["refine_workers"] for p in plans] == [1, 2]
    rows = [p["plan"]["refine"] for p in plans]
    assert [r["layer"] for r in rows[1]] == list(range(len(rows[1]))) and len(rows[1]) == 4 and rows[0] == rows[1]
    assert any(r["kept"] for r in rows[1])  # the workers' training was kept, not thrown away
    assert plans[0]["plan"]["refine_model"]["curve"] == plans[1]["plan"]["refine_model"]["curve"]


def test_auto_workers_where_they_pay(monkeypatch):
    """auto: two workers on a CPU with two or more threads, layers on the source's stream, and a refinement estimated
    at AUTO_MIN_SECONDS or more; one process elsewhere; a number given is taken, at most one per layer."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    long = workers.AUTO_MIN_SECONDS
    assert workers.resolve_workers(None, "cpu", 200, "source", 30, long) == 2
    assert workers.resolve_workers(None, "cpu", 200, "source", 30, long - 1) == 1
    assert workers.resolve_workers(None, "cuda", 200, "source", 30, long) == 1
    assert workers.resolve_workers(None, "cpu", 200, "converted", 30, long) == 1
    assert workers.resolve_workers(None, "cpu", 0, "source", 30, long) == 1
    assert workers.resolve_workers(4, "cpu", 200, "source", 3, 0) == 3
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert workers.resolve_workers(None, "cpu", 200, "source", 30, long) == 1


@pytest.mark.parametrize("queries", [16, 0])
def test_estimate_counts_the_workers(four_layers, calib_text, queries):
    """`--dry-run`'s refinement estimate with two workers is one process's over `workers.speedup` of the step's kind,
    and the plan says that layers refine two at once."""
    from mla_convert.checkpoint import open_source
    from mla_convert.convert import ConvertOptions, convert

    def plan(processes: int):
        options = ConvertOptions(calib_data=str(calib_text), calib_samples=4, calib_seq_len=64, rank=4, refine_steps=50,
                                 refine_queries=queries, refine_workers=processes)
        return convert(open_source(str(four_layers)), four_layers.parent / "never", options, dry_run=True)

    alone, shared = plan(1), plan(2)
    assert shared.refine_seconds == pytest.approx(alone.refine_seconds / workers.speedup(queries))
    assert workers.speedup(queries) == (workers.SPEEDUP if queries else workers.SPEEDUP_WHOLE)
    assert "2 layers at once" in shared.describe() and "layers at once" not in alone.describe()
    assert not (four_layers.parent / "never").exists()


def test_workers_on_a_gpu_are_refused(four_layers, calib_text):
    """Workers are CPU processes: asked for on a GPU device, the plan refuses them with one line that names the fix
    (`auto` takes one process there)."""
    from mla_convert.checkpoint import open_source
    from mla_convert.convert import ConvertOptions, convert
    from mla_convert.errors import UserError

    options = ConvertOptions(calib_data=str(calib_text), rank=4, refine_steps=5, refine_workers=2, device="cuda")
    with pytest.raises(UserError, match="--refine-workers 2 refines layers in CPU processes.*drop --refine-workers"):
        convert(open_source(str(four_layers)), four_layers.parent / "never", options, dry_run=True)
