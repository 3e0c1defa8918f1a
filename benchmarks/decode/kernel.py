"""The decode benchmark's attention-core table on CUDA (the Triton kernel against the torch paths, GPU time per call
from CUDA-graph replays) and the kernel's launch-knob sweep."""

from __future__ import annotations

import functools
import gc
import math

import torch

from benchmarks.decode.models import source_config_from
from benchmarks.decode.timing import graph_seconds, time_fn


def input_sets(set_bytes: int, target: int = 256 * 2**20, most: int = 256) -> int:
    """How many input sets to rotate through so that together they are several times the L2 cache (50 MB on H100)."""
    return max(2, min(most, math.ceil(target / max(set_bytes, 1))))


def kernel_inputs(batch, context, heads, d_c, d_r, n_kv, d_h, dtype, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen)

    return {"q_latent": rand(batch, heads, d_c), "q_rope": rand(batch, heads, d_r), "latent": rand(batch, context, d_c),
            "k_rope": rand(batch, context, d_r), "q": rand(batch, heads, 1, d_h), "k": rand(batch, n_kv, context, d_h),
            "v": rand(batch, n_kv, context, d_h)}


def kernel_shapes(mla):
    attn = mla.model.layers[0].self_attn
    src = source_config_from(mla.config)
    return attn.num_heads, attn.kv_lora_rank, attn.qk_rope_head_dim, src.num_key_value_heads, src.head_dim, attn.scaling


@torch.no_grad()
def bench_kernel(mla, args, device, dtype, copy_bw, log):
    """CUDA only: the attention core alone, at the same shapes, each timed as GPU time per call (CUDA graph replays
    over rotating input sets, cold L2): the Triton kernel; the model's torch absorbed path (`latent_attention`, the
    A_CC_ME core: rope scores as an sdpa bias); the float32 torch reference; the source's GQA sdpa (default dispatch,
    and the flash backend forced). Also the Triton kernel called eagerly (one call, Python launch cost included)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from mla_convert.kernels import mla_decode, mla_decode_reference
    from mla_convert.modeling.modeling_mla import latent_attention

    heads, d_c, d_r, n_kv, d_h, scale = kernel_shapes(mla)
    esize = torch.tensor([], dtype=dtype).element_size()
    rows = []
    for batch in args.kernel_batches:
        for context in args.kernel_contexts:
            mla_bytes = batch * context * (d_c + d_r) * esize
            src_bytes = batch * context * 2 * n_kv * d_h * esize
            n_sets = input_sets(src_bytes)
            sets = [kernel_inputs(batch, context, heads, d_c, d_r, n_kv, d_h, dtype, device, seed)
                    for seed in range(n_sets)]
            lengths = torch.full((batch,), context, dtype=torch.int32, device=device)

            def forms(x):
                def flash():
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        return sdpa(x["q"], x["k"], x["v"], enable_gqa=True)

                return {
                    "triton": lambda: mla_decode(x["q_latent"], x["q_rope"], x["latent"], x["k_rope"], lengths, scale,
                                                 backend="triton"),
                    "torch_absorbed": lambda: latent_attention(x["q_latent"][:, :, None], x["q_rope"][:, :, None],
                                                               x["latent"][:, None], x["k_rope"][:, None], None, scale),
                    "reference": lambda: mla_decode_reference(x["q_latent"], x["q_rope"], x["latent"], x["k_rope"],
                                                              lengths, scale),
                    "sdpa": lambda: sdpa(x["q"], x["k"], x["v"], enable_gqa=True),
                    "sdpa_flash": flash,
                }

            per_set = [forms(x) for x in sets]
            us = {}
            for name in per_set[0]:
                try:
                    us[name] = graph_seconds([f[name] for f in per_set], device) * 1e6
                except RuntimeError as err:  # e.g. no flash kernel for these inputs
                    log(f"kernel {name} B={batch} ctx={context}: {str(err).splitlines()[0]}")
                    us[name] = None
            x = sets[0]
            us["triton_eager"] = time_fn(per_set[0]["triton"], device, reps=50, warmup=5) * 1e6
            # The kernel's output against the float32 reference, on this run's inputs.
            got = per_set[0]["triton"]().float()
            want = mla_decode_reference(x["q_latent"].float(), x["q_rope"].float(), x["latent"].float(),
                                        x["k_rope"].float(), lengths, scale)
            rel_err = float((got - want).norm() / want.norm())
            row = {"batch": batch, "context": context, "us": us, "mla_bytes": mla_bytes, "src_bytes": src_bytes,
                   "input_sets": n_sets, "triton_rel_err": rel_err, "copy_bw": copy_bw,
                   "triton_bw": mla_bytes / (us["triton"] / 1e6),
                   "torch_absorbed_bw": mla_bytes / (us["torch_absorbed"] / 1e6),
                   "sdpa_bw": src_bytes / (us["sdpa"] / 1e6)}
            rows.append(row)
            log(f"kernel B={batch:<3d} ctx={context:<6d} " +
                "  ".join(f"{k} {v:8.1f} us" for k, v in us.items() if v is not None) +
                f"  triton {row['triton_bw'] / 1e9:.0f} GB/s ({row['triton_bw'] / copy_bw:.0%} of copy), "
                f"rel err {rel_err:.1e}")
            del sets, per_set
            gc.collect()
            torch.cuda.empty_cache()
    return rows


SWEEP_SHAPES = [(1, 8192), (1, 32768), (8, 8192), (8, 32768), (32, 32768), (32, 65536)]


def sweep_variants(d_c: int = 64):
    """The launch variants the sweep times, the kernel's defaults first ({}). A latent wider than 64 gets its own
    set (benchmarks/decode_gpu/decode_gpu.sweep144.json, d_c 144): row blocks 32-128, 4 or 8 warps, 2 or 3 stages, two
    split
    rules (that run also timed the latent read as two tiles, 128 + 16, an experiment since removed: 11% slower)."""
    if d_c > 64:
        block_ns, stages, rules = (32, 64, 128), (2, 3), ((2, 256, 2048, 64), (4, 128, None, 128))
    else:
        block_ns, stages = (64, 128, 256), (2, 3, 4)
        rules = ((2, 256, None, 64), (2, 256, 2048, 64), (4, 128, None, 128), (8, 64, None, 256))
    return [{}] + [dict(block_n=block_n, num_warps=num_warps, num_stages=num_stages, programs_per_sm=ppsm,
                        min_split_rows=min_rows, max_split_rows=max_rows, max_splits=most)
                   for block_n in block_ns for num_warps in (4, 8) for num_stages in stages
                   for ppsm, min_rows, max_rows, most in rules]


@torch.no_grad()
def kernel_sweep(mla, device, dtype, copy_bw, log):
    """CUDA only: the Triton kernel's launch knobs (row block, warps, pipeline stages, split heuristic) over a few
    shapes, GPU time per call as in `bench_kernel`; each variant's output is checked against the reference."""
    from mla_convert.kernels import mla_decode_reference
    from mla_convert.kernels.triton_mla import launch_config, mla_decode_triton

    heads, d_c, d_r, n_kv, d_h, scale = kernel_shapes(mla)
    esize = torch.tensor([], dtype=dtype).element_size()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = []
    variants = sweep_variants(d_c)
    for batch, context in SWEEP_SHAPES:
        mla_bytes = batch * context * (d_c + d_r) * esize
        n_sets = input_sets(mla_bytes)
        sets = [kernel_inputs(batch, context, heads, d_c, d_r, 1, 16, dtype, device, seed) for seed in range(n_sets)]
        lengths = torch.full((batch,), context, dtype=torch.int32, device=device)
        x = sets[0]
        want = mla_decode_reference(x["q_latent"].float(), x["q_rope"].float(), x["latent"].float(),
                                    x["k_rope"].float(), lengths, scale)
        for tune in variants:
            cfg = launch_config(batch, heads, context, d_c, d_r, sms, **tune)
            row = {"batch": batch, "context": context, "tune": tune, "num_splits": cfg["num_splits"]}
            try:
                got = mla_decode_triton(x["q_latent"], x["q_rope"], x["latent"], x["k_rope"], lengths, scale,
                                        tune=tune).float()
                row["rel_err"] = float((got - want).norm() / want.norm())
                seconds = graph_seconds([functools.partial(mla_decode_triton, y["q_latent"], y["q_rope"], y["latent"],
                                                           y["k_rope"], lengths, scale, tune=tune) for y in sets],
                                        device)
                row["us"] = seconds * 1e6
                row["bw"] = mla_bytes / seconds
            except Exception as err:  # noqa: BLE001 - e.g. out of shared memory for a large block and many stages
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            rows.append(row)
        ok = [r for r in rows if r["batch"] == batch and r["context"] == context and "us" in r]
        best = min(ok, key=lambda r: r["us"])
        default = ok[0]  # the {} variant: launch_config's defaults
        log(f"sweep  B={batch:<3d} ctx={context:<6d} default {default['us']:7.1f} us "
            f"({default['bw'] / 1e9:5.0f} GB/s)  best {best['us']:7.1f} us ({best['bw'] / 1e9:5.0f} GB/s, "
            f"{best['bw'] / copy_bw:.0%} of copy) {best['tune']} splits {best['num_splits']}; "
            f"max rel err {max(r['rel_err'] for r in ok):.1e}; {len(ok)}/{len(variants)} ran")
        del sets
        gc.collect()
        torch.cuda.empty_cache()
    return rows
