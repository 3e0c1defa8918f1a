"""RoPE fit: how the native model's kept rotary pairs map onto DeepSeek-V3's one geometric frequency set.

`fit_deepseek_rope` maps every layer's kept frequencies onto `base^(-2m/d_r)` (exact, or the least-squares base with
the error said); `deepseek_compatible_rope_pairs` names the pairs that export exactly; `check_exportable` asks the
same of a finished native checkpoint; `place_rope_rows` moves native rotate_half rope rows to DeepSeek's interleaved
rows.

This rule of the DeepSeek-V3 format lives in a room of its own, below both conversion/ and export/: the conversion
resolves `--target deepseek` with it before any work (conversion/target.py), the export maps the rope rows with it, and
neither of the two imports the other.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mla_convert.errors import UserError
from mla_convert.rope import source_frequencies

FREQ_TOLERANCE = 1e-5  # relative: two inverse frequencies this close are the same frequency (float32 rounding)


@dataclass
class RopeFit:
    """How the native per-layer rope pairs map onto DeepSeek's one geometric frequency set.

    `order[layer][m]` is the native pair index (in 0..d_r/2) with the m-th fastest frequency; it rotates with
    `base^(-2m/d_r)` in the export. (With rope padding, see `_place_rope_rows`, it sits at DeepSeek pair m*stride of
    `d_r*stride` dims, which has the same frequency.)
    """

    base: float
    order: list[list[int]]
    exact: bool
    max_freq_rel_error: float
    problems: list[str] = field(default_factory=list)


def fit_deepseek_rope(inv_freq: torch.Tensor, rope_pairs: list[list[int]], tolerance: float = FREQ_TOLERANCE) -> RopeFit:
    """Map every layer's kept frequencies onto one set `base^(-2m/d_r)`, m = 0..d_r/2-1 (DeepSeek's, default type).

    Exact when all layers keep the same frequencies and those form a geometric sequence starting at 1 (e.g. the
    fastest r pairs, base' = base^(2r/d_h), or every s-th pair from the fastest, base' = base^(2rs/d_h)). Otherwise
    the least-squares base in log space is returned with `exact=False`: each layer's pairs, fastest first, take the
    DeepSeek frequencies in order, and `max_freq_rel_error` says how far any pair moved.
    """
    freqs = inv_freq.double()
    pairs = len(rope_pairs[0])
    order, sorted_freqs, problems = [], [], []
    for layer, idx in enumerate(rope_pairs):
        f = freqs[torch.tensor(idx, dtype=torch.long)]
        perm = torch.argsort(f, descending=True, stable=True)
        order.append(perm.tolist())
        sorted_freqs.append(f[perm])
        if len(set(idx)) != len(idx):
            problems.append(f"layer {layer} keeps frequency pairs {sorted(idx)} with repeats (several kv components "
                            "on one frequency); DeepSeek's frequencies are distinct")
    sf = torch.stack(sorted_freqs)  # [L, r], fastest first
    k = torch.arange(pairs, dtype=torch.float64)
    if pairs > 1:
        # log f_k = -k * (2/d_r) * ln(base): least squares through the origin over all layers
        log_rho = float((sf.log() * k).sum() / (k * k).sum() / sf.shape[0])
        base = math.exp(-log_rho * pairs)
    else:
        base, log_rho = 10000.0, 0.0  # one pair rotates at frequency 1 whatever the base
    target = torch.exp(log_rho * k)  # [r]: DeepSeek's inv_freq, 1 first
    rel = (target / sf - 1).abs()
    max_rel = float(rel.max())
    if (sf[:, 0] - 1).abs().max() > tolerance:
        problems.append(f"the fastest kept frequency is {float(sf[:, 0].min()):.4g}, not 1 (DeepSeek's pair 0 always "
                        "rotates at 1 rad/token): keep the fastest source pair")
    if (sf - sf[0]).abs().max() > tolerance * sf[0].abs().max():
        bad = next(i for i in range(1, sf.shape[0]) if sorted(rope_pairs[i]) != sorted(rope_pairs[0]))
        problems.append(f"layers keep different frequency pairs (layer 0 {sorted(rope_pairs[0])}, layer {bad} "
                        f"{sorted(rope_pairs[bad])}); DeepSeek has one frequency set for all layers")
    if max_rel > tolerance and not problems:
        problems.append(f"the kept frequencies are not geometric (max relative deviation {max_rel:.3g}; e.g. RoPE "
                        "scaling that bends them, or a non-uniform pair choice)")
    exact = max_rel <= tolerance and not problems
    return RopeFit(base=base, order=order, exact=exact, max_freq_rel_error=max_rel, problems=problems)


def deepseek_compatible_rope_pairs(
    head_dim: int, rope_dims: int, strategy: str = "uniform", inv_freq: torch.Tensor | None = None
) -> list[int]:
    """Source frequency indices a converter can keep so that the result exports exactly to DeepSeek-V3.

    `strategy` "high": the fastest `rope_dims/2` pairs (base' = base^(rope_dims/head_dim)); "uniform": every s-th pair
    from the fastest, s = (head_dim/2) // (rope_dims/2) (base' = base^(s*rope_dims/head_dim)). Use the same list for
    every layer, one kv component per frequency (merging across kv heads keeps that when each frequency is taken
    once). With `inv_freq` (the source's, after any RoPE scaling), the set is checked to be geometric and a
    UserError says why not. "low" and "2-norm" choices are not exportable (their fastest pair is not frequency 1, or
    they differ per layer).
    """
    half, count = head_dim // 2, rope_dims // 2
    if rope_dims % 2 or not 0 < count <= half:
        raise UserError(f"rope dims must be even and in [2, {head_dim}] for a DeepSeek export, got {rope_dims}")
    if strategy == "high":
        pairs = list(range(count))
    elif strategy == "uniform":
        stride = half // count
        pairs = [m * stride for m in range(count)]
    else:
        raise UserError(f"--rope-strategy {strategy} does not give a DeepSeek-exportable model: use high or uniform")
    if inv_freq is not None:
        fit = fit_deepseek_rope(inv_freq, [pairs])
        if not fit.exact:
            raise UserError(f"the {strategy} pairs {pairs} do not export exactly: {fit.problems[0]}; "
                            "try --rope-strategy high (RoPE scaling usually leaves the fastest pairs alone)")
    return pairs


def check_exportable(folder: str | os.PathLike) -> list[str]:
    """Problems that keep the native checkpoint `folder` from an exact DeepSeek-V3 export (RoPE only; cheap)."""
    from mla_convert.modeling import MLAConfig

    config = MLAConfig.from_pretrained(Path(folder))
    inv_freq, _ = source_frequencies(config)
    return fit_deepseek_rope(inv_freq, config.rope_pairs).problems


def place_rope_rows(x: torch.Tensor, order: list[int], out_dim: int, stride: int) -> torch.Tensor:
    """Native rotate_half rope rows -> DeepSeek interleaved rows, along dim 1 of x [N, d_r, ...] -> [N, out_dim, ...].

    Native pair j is (row j, row j + d_r/2); DeepSeek pair k is (row 2k, row 2k+1) and rotates in the same sense
    (first' = first cos - second sin). Native pair order[m] goes to DeepSeek pair m*stride; other rows stay zero.
    """
    half = x.shape[1] // 2
    out = x.new_zeros(x.shape[0], out_dim, *x.shape[2:])
    for m, j in enumerate(order):
        out[:, 2 * m * stride] = x[:, j]
        out[:, 2 * m * stride + 1] = x[:, j + half]
    return out
