"""The absorbed MLA decode kernel against its torch reference (the oracle).

- The reference is checked against a per-sequence loop and the model's own latent attention, in this process.
- The Triton kernel runs on CPU in Triton's interpreter. Triton fixes interpreted-or-compiled when it is first
  imported (TRITON_INTERPRET), so the kernel runs in one child process started with TRITON_INTERPRET=1 (this file run
  as a script): the parent writes every case's inputs to a file, the child writes the kernel's outputs, and each
  case is then compared with the reference here. Other test files are not affected by the variable.
- On CUDA (marked `gpu`, skipped without it) the compiled kernel is compared in this process.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mla_convert.dtypes import DTYPES
from mla_convert.kernels import mla_decode, mla_decode_reference
from mla_convert.modeling.compat import cache_kwargs, output_cache

# (name, B, H, S, d_c, d_r, dtype, num_splits, lengths or None for "random in [1, S]")
CASES = [
    ("single_row", 1, 1, 1, 16, 16, "float32", None, [1]),
    ("smollm_shape", 2, 9, 100, 64, 32, "float32", None, None),  # S not a multiple of BLOCK_N (64)
    ("splits_some_empty", 3, 9, 200, 64, 32, "float32", 4, [200, 37, 64]),  # splits of 64: 37 leaves 3 empty
    ("no_rope", 3, 5, 77, 48, 0, "float32", 3, None),
    ("odd_dims", 2, 4, 33, 20, 6, "float32", 2, [33, 1]),
    ("wide_latent_head_blocks", 2, 20, 70, 300, 16, "float32", 2, None),  # d_c 300 -> 16 heads a block, 2 blocks
    ("batch5_many_splits", 5, 3, 257, 32, 8, "float32", 5, [257, 1, 128, 129, 200]),
    ("float16", 2, 9, 150, 64, 32, "float16", 3, [150, 7]),
    ("strided_queries", 2, 6, 90, 64, 32, "float32", 2, None),  # q views of [B, H, T, d] as the model passes them
    ("merge_chunks", 2, 3, 700, 300, 16, "float32", 20, [700, 333]),  # 11 splits, merged 8 a load; 333 empties 5
    ("smollm_half_budget", 2, 9, 130, 144, 48, "float32", 3, [130, 65]),  # the 50% default: neither dim a power of 2
]
# bfloat16 runs on GPU only: Triton 3.9's interpreter multiplies bf16 dot operands as their raw uint16 bits
# (runtime/interpreter.py, create_dot), so interpreter results for bf16 are meaningless.

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_inputs(name, bsz, heads, seq_len, d_c, d_r, dtype, lengths, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dt)

    if name == "strided_queries":
        q = rand(bsz, 1, heads, d_c + d_r).transpose(1, 2)  # [B, H, 1, d_c + d_r], not contiguous
        q_latent, q_rope = q[:, :, 0, :d_c], q[:, :, 0, d_c:]
    else:
        q_latent, q_rope = rand(bsz, heads, d_c), rand(bsz, heads, d_r)
    latent, k_rope = rand(bsz, seq_len, d_c), rand(bsz, seq_len, d_r)
    if lengths is None:
        lengths = torch.randint(1, seq_len + 1, (bsz,), generator=gen, dtype=torch.int32)
        lengths[0] = seq_len
    else:
        lengths = torch.tensor(lengths, dtype=torch.int32)
    scale = 1.0 / math.sqrt(d_c + d_r)
    to = dict(device=device)
    return q_latent.to(**to), q_rope.to(**to), latent.to(**to), k_rope.to(**to), lengths.to(**to), scale


def loop_reference(q_latent, q_rope, latent, k_rope, lengths, scale, valid=None):
    """The decode step written out one sequence at a time, float64."""
    out = torch.empty(q_latent.shape, dtype=torch.float64)
    lengths = lengths.expand(q_latent.shape[0])
    for b in range(q_latent.shape[0]):
        rows = torch.arange(int(lengths[b]))
        if valid is not None:
            rows = rows[valid.expand(q_latent.shape[0], -1)[b, rows]]
        c, kr = latent[b, rows].double(), k_rope[b, rows].double()
        scores = q_latent[b].double() @ c.T + q_rope[b].double() @ kr.T
        out[b] = torch.softmax(scores * scale, dim=-1) @ c
    return out


def masked_inputs(name):
    """Cases with a `valid` mask (padding) and one length for the batch (a static cache's counter, stride 0)."""
    gen = torch.Generator().manual_seed(3)
    bsz, heads, seq_len, d_c, d_r = 3, 9, 300, 64, 32
    q_latent, q_rope = torch.randn(bsz, heads, d_c, generator=gen), torch.randn(bsz, heads, d_r, generator=gen)
    latent, k_rope = torch.randn(bsz, seq_len, d_c, generator=gen), torch.randn(bsz, seq_len, d_r, generator=gen)
    lengths = torch.tensor(280).expand(bsz)  # int64, stride 0; rows 280.. are a static cache's unwritten rows
    valid = torch.ones(bsz, seq_len + 4, dtype=torch.bool)  # wider than the cache, as a mask may be
    valid[1, :150] = False  # left padding: whole splits of sequence 1 see only masked rows
    valid[2] = torch.rand(seq_len + 4, generator=gen) > 0.3
    valid[2, 279] = True
    if name == "valid_broadcast":
        valid = valid[1:2]  # [1, S]: one mask for the batch
    scale = 1.0 / math.sqrt(d_c + d_r)
    return (q_latent, q_rope, latent, k_rope, lengths, scale), dict(valid=valid)


MASKED = [("valid_padding", 4), ("valid_broadcast", 3), ("valid_one_split", 1)]


# ---------------------------------------------------------------------------------------------- reference


@pytest.mark.parametrize("name", [m[0] for m in MASKED])
def test_reference_with_valid_mask_matches_loop(name):
    inputs, extra = masked_inputs(name)
    want = loop_reference(*inputs, **extra)
    torch.testing.assert_close(mla_decode_reference(*inputs, **extra).double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_reference_matches_loop(case):
    name, bsz, heads, seq_len, d_c, d_r, dtype, _, lengths = case
    inputs = make_inputs(name, bsz, heads, seq_len, d_c, d_r, dtype, lengths)
    got = mla_decode_reference(*inputs)
    assert got.shape == (bsz, heads, d_c) and got.dtype == DTYPES[dtype]
    want = loop_reference(*inputs)
    torch.testing.assert_close(got.double(), want, atol=TOL[DTYPES[dtype]], rtol=TOL[DTYPES[dtype]])


def test_reference_ignores_rows_past_length():
    q_latent, q_rope, latent, k_rope, lengths, scale = make_inputs("x", 2, 3, 40, 16, 8, "float32", [25, 40])
    first = mla_decode_reference(q_latent, q_rope, latent, k_rope, lengths, scale)
    latent2, k_rope2 = latent.clone(), k_rope.clone()
    latent2[0, 25:] = 1e4
    k_rope2[0, 25:] = float("nan")
    second = mla_decode_reference(q_latent, q_rope, latent2, k_rope2, lengths, scale)
    torch.testing.assert_close(first, second)


def test_reference_matches_model_latent_attention():
    from mla_convert.modeling.modeling_mla import latent_attention

    q_latent, q_rope, latent, k_rope, lengths, scale = make_inputs("x", 2, 9, 50, 64, 32, "float32", [50, 50])
    model_out = latent_attention(
        q_latent[:, :, None], q_rope[:, :, None], latent[:, None], k_rope[:, None], None, scale
    )  # [B, H, 1, d_c]
    torch.testing.assert_close(mla_decode_reference(q_latent, q_rope, latent, k_rope, lengths, scale),
                               model_out[:, :, 0], atol=1e-5, rtol=1e-5)


def test_dispatch_on_cpu_uses_reference():
    inputs = make_inputs("x", 2, 3, 20, 16, 8, "float32", None)
    assert torch.equal(mla_decode(*inputs), mla_decode_reference(*inputs))
    assert torch.equal(mla_decode(*inputs, backend="torch"), mla_decode_reference(*inputs))
    with pytest.raises(ValueError, match="backend"):
        mla_decode(*inputs, backend="cuda")


@pytest.mark.parametrize("bsz,heads,seq_len,d_c,d_r,sms,splits", [
    (1, 9, 8192, 64, 32, 132, None), (8, 9, 8192, 64, 32, 132, None), (64, 128, 32768, 512, 64, 132, None),
    (3, 9, 100, 64, 32, 1, 4), (2, 4, 33, 20, 6, 1, 50), (1, 1, 1, 16, 0, 132, None),
])
def test_launch_config_covers_the_sequence(bsz, heads, seq_len, d_c, d_r, sms, splits):
    pytest.importorskip("triton")
    from mla_convert.kernels.triton_mla import launch_config

    cfg = launch_config(bsz, heads, seq_len, d_c, d_r, sms, splits)
    assert cfg["split_len"] % cfg["BLOCK_N"] == 0
    assert (cfg["num_splits"] - 1) * cfg["split_len"] < seq_len <= cfg["num_splits"] * cfg["split_len"]
    assert cfg["head_blocks"] * cfg["BLOCK_H"] >= heads
    for key in ("BLOCK_H", "BLOCK_N", "BLOCK_C", "BLOCK_R"):  # powers of two, >= 16 (tl.dot)
        assert cfg[key] >= 16 and cfg[key] & (cfg[key] - 1) == 0
    assert cfg["BLOCK_C"] >= d_c and cfg["BLOCK_R"] >= d_r


def test_launch_config_tuning_knobs():
    pytest.importorskip("triton")
    from mla_convert.kernels.triton_mla import launch_config

    default = launch_config(1, 9, 32768, 64, 32, 132)
    assert (default["num_splits"], default["split_len"], default["BLOCK_N"], default["num_stages"]) == (64, 512, 128, 3)
    batch_filled = launch_config(32, 9, 32768, 64, 32, 132)  # 32 sequences fill the SMs: splits of at most 2048 rows
    assert (batch_filled["num_splits"], batch_filled["split_len"]) == (16, 2048)
    long_splits = launch_config(32, 9, 32768, 64, 32, 132, max_split_rows=None)  # the batch-filling rule alone
    assert (long_splits["num_splits"], long_splits["split_len"]) == (9, 3712)
    wide_latent = launch_config(1, 16, 4096, 512, 64, 132)
    assert (wide_latent["BLOCK_N"], wide_latent["num_stages"]) == (32, 2)  # shared memory
    half_budget = launch_config(8, 9, 32768, 144, 48, 132)  # SmolLM2 at 50%: a 256-wide tile, 32 rows, 3 stages
    assert (half_budget["BLOCK_C"], half_budget["BLOCK_N"], half_budget["num_stages"]) == (256, 32, 3)
    wide = launch_config(1, 9, 32768, 64, 32, 132, block_n=128, programs_per_sm=8, min_split_rows=64, max_splits=256,
                         num_warps=8, num_stages=3)
    assert (wide["num_splits"], wide["split_len"], wide["BLOCK_N"]) == (256, 128, 128)
    assert (wide["num_warps"], wide["num_stages"]) == (8, 3)


# ---------------------------------------------------------------------------------------------- interpreter


TINY_MLA = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, kv_lora_rank=[24, 20], qk_rope_head_dim=8,
                max_position_embeddings=128, attention_bias=True)


def _model_decode_logits(kernel: str, cache: str = "dynamic"):
    """Prefill 5 tokens of a tiny random MLA model, then 3 greedy decode steps; stacked decode logits.

    cache "static": a preallocated StaticCache of 16 rows and a left-padded batch (sequence 0 starts with 2 pad
    tokens), as `generate` runs it: the kernel then reads the cache's counter on the device and the padding mask."""
    from transformers import StaticCache

    from mla_convert.modeling import MLAConfig, MLAForCausalLM

    torch.manual_seed(0)
    model = MLAForCausalLM(MLAConfig(**TINY_MLA, mla_decode_kernel=kernel)).eval()
    ids = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 5, dtype=torch.long)
    past = None
    if cache == "static":
        mask[0, :2] = 0
        past = StaticCache(config=model.config, max_cache_len=16)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=positions, **cache_kwargs(past), use_cache=True)
        steps = []
        for _ in range(3):
            nxt = out.logits[:, -1:].argmax(-1)
            mask = torch.cat((mask, torch.ones(2, 1, dtype=torch.long)), dim=1)
            positions = positions[:, -1:] + 1
            out = model(nxt, attention_mask=mask, position_ids=positions, **cache_kwargs(output_cache(out)),
                        use_cache=True)
            steps.append(out.logits[:, -1])
    return torch.stack(steps)


def _interpreter_scalar_loop_bounds() -> None:
    """Let older Triton interpreters take a runtime loop bound under NumPy >= 2.5.

    The interpreter holds scalars as 1-element arrays and converts a `range` bound with `int(array)`; Triton 3.6 does
    that without squeezing, which NumPy 2.5 refuses ("only 0-dimensional arrays can be converted to Python scalars").
    This wraps the interpreter's tensor patching so `__index__` squeezes first (newer Triton already does). Test-only:
    it runs in the interpreter child process.
    """
    import numpy as np
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_squeezes_index", False):
        return

    def patched(tensor, *args, **kwargs):
        result = original(tensor, *args, **kwargs)
        tensor.__index__ = lambda self: int(np.asarray(self.handle.data).reshape(-1)[0])
        return result

    patched._squeezes_index = True
    interpreter._patch_lang_tensor = patched


def _worker(in_path: str, out_path: str) -> None:
    """Child process (TRITON_INTERPRET=1): run the kernel on every case, and the tiny model with the kernel forced."""
    import mla_convert.kernels.triton_mla as triton_mla

    _interpreter_scalar_loop_bounds()

    payload = torch.load(in_path)
    results = {}
    for name, (inputs, num_splits, extra) in payload.items():
        results[name] = mla_decode(*inputs, backend="triton", num_splits=num_splits, **extra)
    # Under torch.compile the kernel is one custom operator (fake shapes for tracing, the kernel when run): the
    # decode call traces without a graph break and computes the same thing.
    inputs, _, extra = payload["valid_padding"]
    step = torch.compile(lambda *args: mla_decode(*args, backend="triton", **extra), backend="aot_eager",
                         fullgraph=True)
    results["compiled:valid_padding"] = step(*inputs)

    calls = []
    original = triton_mla.mla_decode_triton

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    triton_mla.mla_decode_triton = counting
    results["model_triton"] = _model_decode_logits("triton")
    results["model_kernel_calls"] = torch.tensor(len(calls))
    results["model_triton_static"] = _model_decode_logits("triton", cache="static")
    results["model_kernel_calls_static"] = torch.tensor(len(calls))
    triton_mla.mla_decode_triton = original
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    pytest.importorskip("triton")
    folder = tmp_path_factory.mktemp("triton_interpret")
    payload = {}
    for name, bsz, heads, seq_len, d_c, d_r, dtype, num_splits, lengths in CASES:
        payload[name] = (make_inputs(name, bsz, heads, seq_len, d_c, d_r, dtype, lengths), num_splits, {})
    for name, num_splits in MASKED:
        payload[name] = (*masked_inputs(name)[:1], num_splits, masked_inputs(name)[1])
    torch.save(payload, folder / "in.pt")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, __file__, "worker", str(folder / "in.pt"), str(folder / "out.pt")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"interpreter worker failed:\n{proc.stdout}\n{proc.stderr}"
    return payload, torch.load(folder / "out.pt")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_interpreted_kernel_matches_reference(interpreted, case):
    payload, results = interpreted
    name, dtype = case[0], DTYPES[case[6]]
    inputs, _, _ = payload[name]
    got = results[name]
    want = mla_decode_reference(*inputs)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("name", [m[0] for m in MASKED])
def test_interpreted_kernel_with_valid_mask_and_one_length_matches_reference(interpreted, name):
    payload, results = interpreted
    inputs, _, extra = payload[name]
    torch.testing.assert_close(results[name], mla_decode_reference(*inputs, **extra), atol=2e-5, rtol=2e-5)


def test_kernel_compiles_as_one_operator(interpreted):
    payload, results = interpreted
    inputs, _, extra = payload["valid_padding"]
    torch.testing.assert_close(results["compiled:valid_padding"], mla_decode_reference(*inputs, **extra),
                               atol=2e-5, rtol=2e-5)


def test_kernel_operator_fake_shapes():
    from torch._subclasses import FakeTensorMode

    with FakeTensorMode():
        inputs = make_inputs("x", 2, 9, 100, 64, 32, "bfloat16", None)
        out = torch.ops.mla_convert.mla_decode_triton(*inputs, None)
    assert out.shape == (2, 9, 64) and out.dtype == torch.bfloat16


def test_model_decode_with_interpreted_kernel_matches_torch_path(interpreted):
    _, results = interpreted
    assert int(results["model_kernel_calls"]) == 3 * TINY_MLA["num_hidden_layers"]  # every decode step, every layer
    torch.testing.assert_close(results["model_triton"], _model_decode_logits("torch"), atol=1e-4, rtol=1e-4)


def test_static_cache_padded_decode_with_interpreted_kernel_matches_torch_path(interpreted):
    """A preallocated cache, a left-padded batch: the kernel (counter read on the device, padding from the mask)
    gives the torch path's logits (the torch path with a static cache against the dynamic one: test_cache.py)."""
    _, results = interpreted
    assert int(results["model_kernel_calls_static"]) == 2 * 3 * TINY_MLA["num_hidden_layers"]
    torch_static = _model_decode_logits("torch", cache="static")
    torch.testing.assert_close(results["model_triton_static"], torch_static, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------- CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GPU_CASES = [
    (1, 9, 8192, 64, 32), (8, 9, 8193, 64, 32), (4, 16, 1000, 512, 64), (2, 128, 4096, 512, 64), (3, 5, 77, 48, 0),
    (16, 9, 32768, 64, 32),
    (8, 9, 4099, 144, 48),  # SmolLM2-135M at 50% of its cache (the default d_r 48, d_c 144)
    (4, 32, 3000, 448, 64),  # Llama-3-8B at 25% (d_r 64, d_c 448)
]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("shape", GPU_CASES, ids=lambda s: "x".join(map(str, s)))
def test_cuda_kernel_matches_reference(shape, dtype):
    bsz, heads, seq_len, d_c, d_r = shape
    inputs = make_inputs("x", bsz, heads, seq_len, d_c, d_r, dtype, None, device="cuda")
    got = mla_decode(*inputs)  # auto: the kernel on CUDA
    want = mla_decode_reference(*inputs)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[DTYPES[dtype]], rtol=TOL[DTYPES[dtype]])
    for splits in (1, 3):
        torch.testing.assert_close(mla_decode(*inputs, backend="triton", num_splits=splits).float(), want.float(),
                                   atol=TOL[DTYPES[dtype]], rtol=TOL[DTYPES[dtype]])


# Launch knobs the benchmark sweeps (benchmarks/decode/run.py --kernel-sweep): each must compute the same function.
# Wide latents take small row blocks only (a 512-wide latent block of 128 rows and 3 stages outgrows shared memory).
NARROW_TUNES = [dict(block_n=64, num_warps=4, num_stages=2), dict(block_n=256, num_warps=8, num_stages=2),
                dict(block_n=256, num_warps=4, num_stages=4),
                dict(block_n=32, num_warps=4, num_stages=4, programs_per_sm=8, min_split_rows=64, max_splits=256)]
WIDE_TUNES = [dict(block_n=16, num_warps=8, num_stages=3),
              dict(block_n=32, num_warps=4, num_stages=2, programs_per_sm=8, min_split_rows=64, max_splits=256)]
TUNE_CASES = [(shape, tune) for shape in [(1, 9, 32768, 64, 32), (8, 9, 5000, 64, 32)] for tune in NARROW_TUNES]
TUNE_CASES += [((2, 16, 3000, 512, 64), tune) for tune in WIDE_TUNES]
# The 50% shape of SmolLM2 (d_c 144 in a 256-wide tile) at the row blocks and stages its sweep tried.
TUNE_CASES += [((8, 9, 4099, 144, 48), tune) for tune in [dict(block_n=64, num_stages=3), dict(num_stages=2),
                                                          dict(block_n=128, num_warps=8, num_stages=2)]]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("shape,tune", TUNE_CASES,
                         ids=["x".join(map(str, s)) + "-" + "-".join(f"{k}{v}" for k, v in t.items())
                              for s, t in TUNE_CASES])
def test_cuda_kernel_tuning_knobs(shape, tune):
    from mla_convert.kernels.triton_mla import mla_decode_triton

    bsz, heads, seq_len, d_c, d_r = shape
    inputs = make_inputs("x", bsz, heads, seq_len, d_c, d_r, "bfloat16", None, seed=3, device="cuda")
    want = mla_decode_reference(*inputs)
    got = mla_decode_triton(*inputs, tune=tune)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])


@pytest.mark.gpu
@cuda
def test_cuda_model_decode_uses_kernel_and_matches_torch(monkeypatch):
    import mla_convert.kernels.triton_mla as triton_mla
    from mla_convert.modeling import MLAConfig, MLAForCausalLM

    calls = []
    original = triton_mla.mla_decode_triton

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(triton_mla, "mla_decode_triton", counting)
    torch.manual_seed(0)
    model = MLAForCausalLM(MLAConfig(**TINY_MLA)).eval().cuda()
    ids = torch.randint(0, 100, (2, 5), device="cuda")
    logits = {}
    for kernel in ("auto", "torch"):
        model.config.mla_decode_kernel = kernel
        with torch.no_grad():
            out = model(ids, use_cache=True)
            out = model(ids[:, :1], **cache_kwargs(output_cache(out)), use_cache=True)
        logits[kernel] = out.logits
        if kernel == "auto":  # the decode step ran the kernel in every layer; the prefill did not
            assert len(calls) == TINY_MLA["num_hidden_layers"]
    assert len(calls) == TINY_MLA["num_hidden_layers"]  # "torch" never calls it
    torch.testing.assert_close(logits["auto"], logits["torch"], atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@cuda
def test_cuda_graph_static_decode_matches_eager():
    """The decode step over a StaticCache, captured once in a CUDA graph and replayed step after step (new token,
    position and a left-padded mask copied into its input buffers), gives the eager torch path's logits: the step
    reads no length on the host, and each replay writes the cache row the counter on the device points at."""
    from transformers import StaticCache

    from mla_convert.modeling import MLAConfig, MLAForCausalLM

    torch.manual_seed(0)
    model = MLAForCausalLM(MLAConfig(**TINY_MLA)).eval().cuda()
    capacity, steps = 16, 4
    ids = torch.randint(0, 100, (2, 5), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    mask = torch.zeros(2, capacity, dtype=torch.long, device="cuda")
    mask[:, :5 + steps] = 1
    mask[0, :2] = 0  # sequence 0 starts with two pad tokens
    positions = (mask[:, :5].cumsum(-1) - 1).clamp(min=0)

    def decode(graph: bool) -> torch.Tensor:
        model.config.mla_decode_kernel = "auto" if graph else "torch"
        cache = StaticCache(config=model.config, max_cache_len=capacity)
        with torch.no_grad():
            out = model(ids, attention_mask=mask[:, :5], position_ids=positions, **cache_kwargs(cache),
                        use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            position = positions[:, -1:] + 1
            run = lambda: model(token, attention_mask=mask, position_ids=position, **cache_kwargs(cache),  # noqa: E731
                                use_cache=True).logits[:, -1]
            if graph:
                counters = [layer.cumulative_length.clone() for layer in cache.layers]
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):  # warm-up (kernel compile) off the capture, then set the counters back
                    run()
                torch.cuda.current_stream().wait_stream(stream)
                for layer, count in zip(cache.layers, counters):
                    layer.cumulative_length.copy_(count)
                captured = torch.cuda.CUDAGraph()
                with torch.cuda.graph(captured):
                    logits = run()
            found = []
            for _ in range(steps):
                if graph:
                    captured.replay()
                else:
                    logits = run()
                found.append(logits.clone())
                token.copy_(logits.argmax(-1, keepdim=True))
                position += 1
        return torch.stack(found)

    eager = decode(graph=False)
    replayed = decode(graph=True)
    assert int(replayed.isfinite().all()) == 1
    torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@cuda
def test_cuda_generate_static_compiled_matches_dynamic():
    """`generate(cache_implementation="static")` on CUDA, where transformers compiles the decode step (mode
    reduce-overhead: CUDA graphs) with the kernel as one custom operator, gives the default cache's tokens; the
    decode step compiles as one graph (a graph break made Dynamo recompile each layer's attention, then fall back
    to eager: 29 tokens/s against the source's 435 on an H100)."""
    from transformers import CompileConfig

    from mla_convert.modeling import MLAConfig, MLAForCausalLM

    torch.manual_seed(0)
    model = MLAForCausalLM(MLAConfig(**TINY_MLA)).eval().cuda()
    ids = torch.randint(0, 100, (2, 6), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    options = dict(attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False, eos_token_id=None,
                   pad_token_id=0)
    dynamic = model.generate(ids, **options)
    static = model.generate(ids, cache_implementation="static", compile_config=CompileConfig(fullgraph=True),
                            **options)
    assert torch.equal(static, dynamic)


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "worker":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run the worker with TRITON_INTERPRET=1"
    torch.set_num_threads(1)
    _worker(sys.argv[2], sys.argv[3])
    print(json.dumps({"ok": True}))
