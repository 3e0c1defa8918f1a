"""Layer refinement (`--refine-steps`): after the closed-form factorization, the MLA attention's weights are trained
by gradient descent so that its output (after o_proj) matches the source attention's on the calibration activations,
through the real softmax and RoPE (`refine_module`); `stages.refined_layer` is the conversion's stage, one layer.

The closed form minimizes a quadratic proxy (K/V error under input statistics); the rank and RoPE truncation it leaves
behind is a nonlinear error in attention outputs. This step measures that error directly and reduces it, layer by
layer, without labels or a data set: inputs and targets are the calibration text's hidden states (the source's own
sampled text by default). Shapes do not change (the cache and the serving formats are untouched).

Safeguards: one calibration sequence is held out; the refined weights are kept only if they lower its error (a layer
that the closed form already reproduces, e.g. at full rank, has nothing to gain: it is left bit-exact).

The steps' defaults, their CPU time and `auto`'s choices: `conversion.estimates`.
"""

from __future__ import annotations

import logging
import math

import torch

from mla_convert import dtypes
from mla_convert.conversion.statistics import layer_mask
from mla_convert.schema import DEFAULTS, choices

log = logging.getLogger(__name__)
REFINED_LINE = "refine: layer %d held-out error %.4g -> %.4g (%s), %.1f s"  # benchmarks/scale/run.py reads it

EXACT = 1e-9  # relative error below which a layer is already exact (float32 round-off): not refined
# Adam (cosine) on one 2048-token window a step, so that training reaches the positions a 2048-token context holds;
# chosen on the development split: docs/decisions.md#refinement-steps-rate-and-window.
# Windows start at each sequence's first token: crops that start mid-sequence put the attention sink on an arbitrary
# token and train the layer on a pattern it never meets. The steps by the cache kept: `conversion.estimates`.
DEFAULT_LR = DEFAULTS["refine_lr"]  # the options' defaults: mla_convert/schema.py
STEP_TOKENS = 2048  # tokens a step: a shorter window (`--refine-seq-len`) takes more sequences a step
SEQ_LEN = DEFAULTS["refine_seq_len"]
BATCH = STEP_TOKENS // SEQ_LEN
# attention: train the converted attention to the source attention's outputs. layer: train the whole converted decoder
# layer (attention, MLP, norms) to what the source layer adds to the residual stream, so that the MLP can also take
# back what the attention lost. MLP_LR_SCALE (`--refine-mlp-lr-scale`): the MLP's and norms' learning rate / the
# attention's. Both chosen on the development split: docs/decisions.md#refinement-scope-and-the-mlps-rate.
SCOPES = choices("refine_scope")
DEFAULT_SCOPE = DEFAULTS["refine_scope"]
MLP_LR_SCALE = DEFAULTS["refine_mlp_lr_scale"]
# `--refine-precision`: what the training steps of both stages compute in (the weights, the targets and the held-out
# checks stay float32). auto (the default): bfloat16 (autocast) on CPUs with native bfloat16 arithmetic (AVX512-BF16
# or AMX) for models whose hidden size is at least dtypes.BF16_MIN_HIDDEN (`dtypes.cpu_prefers_bf16`), float32
# elsewhere and on GPUs. Chosen on the development split: docs/decisions.md#refinement-precision.
PRECISIONS = choices("refine_precision")
DEFAULT_PRECISION = DEFAULTS["refine_precision"]


def resolve_precision(requested: str, device: str, hidden: int) -> str:
    """`requested` (PRECISIONS), with auto resolved for `device` and a model of hidden size `hidden`."""
    if requested != "auto":
        return requested
    if device.startswith("cpu") and dtypes.cpu_prefers_bf16(hidden):
        return "bfloat16"
    return "float32"


def _compute(x: torch.Tensor, precision: str):
    """The context the training forwards run in: bfloat16 autocast on x's device, or nothing for float32."""
    return torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=precision == "bfloat16")


def batch_for(seq_len: int) -> int:
    """Sequences a step for windows of `seq_len` tokens: STEP_TOKENS a step (at least one sequence)."""
    return max(1, STEP_TOKENS // seq_len)


def stream_targets(source_layer, runner, scope: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) on the runner's current hidden states, float32, on their device: for `scope` attention, the layer's
    attention inputs (after its input norm) [N, T, D] and the source attention's outputs there; for layer, the hidden
    states and what the source layer adds to them (`layer_update`).

    The hidden states are the stream the runner carries: the source's (`--calib-propagate source`), or the converted
    model's (converted: each layer is then trained on the inputs it will see, to do what the source layer would do
    with them). Targets that also asked each layer to take back what the layers before it lost
    (h_src + attn_src(h_src) - h_conv) broke down: not offered
    (docs/decisions.md#refinement-scope-and-the-mlps-rate)."""
    if scope == "attention":
        x, module, forward = runner.attention_input(source_layer), source_layer.self_attn, attention_output
    else:
        x, module, forward = runner.hidden, source_layer, layer_update
    cos, sin = runner.embeddings_at(source_layer.self_attn.layer_idx)
    ys = []
    with torch.no_grad():
        for chunk in x.split(runner.batch):
            pe = (cos.expand(chunk.shape[0], -1, -1), sin.expand(chunk.shape[0], -1, -1))
            ys.append(forward(module, chunk, pe))
    return x, torch.cat(ys)


def attention_output(attn, x, position_embeddings) -> torch.Tensor:
    """What an attention module returns for inputs x (its first output), causal (within the window of a
    sliding-window config)."""
    mask = layer_mask(attn, x.shape[1], x.device)
    return attn(x, position_embeddings=position_embeddings, attention_mask=mask)[0]


def layer_update(layer, x, position_embeddings) -> torch.Tensor:
    """What a decoder layer adds to the residual stream x (attention and MLP): layer(x) - x."""
    out = layer(x, position_embeddings=position_embeddings, attention_mask=layer_mask(layer.self_attn, x.shape[1],
                                                                                     x.device))
    return (out[0] if isinstance(out, tuple) else out) - x


class _WindowKeys:
    """A cache stand-in for `layer_update_at`: whatever the attention would add, `update` returns the whole window's
    latent and rope key (computed, with their gradients, from every position)."""

    def __init__(self, latent: torch.Tensor, k_rope: torch.Tensor):
        self.latent, self.k_rope = latent, k_rope

    def update(self, latent, k_rope, layer_idx):
        return self.latent, self.k_rope


def subset_supported(layer) -> bool:
    """Whether `layer_update_at` computes `layer`'s update at chosen positions (an MLA decoder layer whose keys come
    from its latent and rope key alone: no exact per-token key norm, no sliding window)."""
    attn = getattr(layer, "self_attn", None)
    return (hasattr(attn, "kv_a_proj") and attn.qk_norm != "exact" and attn.sliding_window is None
            and attn.config.mla_attention_mode == "auto")


def layer_update_at(layer, x, position_embeddings, index: torch.Tensor) -> torch.Tensor:
    """`layer_update(layer, x, position_embeddings)[:, index]` for ascending positions `index` [S] of the windows x
    [B, T, D], at about S / T of the cost of the projections and MLP: only the keys (latent and rope key) are formed
    at every position; the queries, attention outputs and MLP at `index` alone, each query attending to every key at
    or before its position."""
    from mla_convert.modeling.modeling_mla import rotate

    attn = layer.self_attn
    normed = x if layer.norm_layout == "post" else layer.input_layernorm(x)
    latent, k_rope = attn.kv_a_proj(normed).split([attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
    latent, k_rope = latent.unsqueeze(1), k_rope.unsqueeze(1)
    if attn.qk_rope_head_dim:
        k_rope = rotate(k_rope, *attn._rope_cos_sin(position_embeddings))
    mask = index[:, None] >= torch.arange(x.shape[1], device=x.device)[None]  # [S, T]: causal at each chosen row
    part = x[:, index]
    cos, sin = position_embeddings
    out = layer(part, position_embeddings=(cos[:, index], sin[:, index]), attention_mask=mask[None, None],
                cache=_WindowKeys(latent, k_rope))
    return (out[0] if isinstance(out, tuple) else out) - part


def adam(groups: list[dict]) -> torch.optim.Adam:
    """Adam over parameter groups (each with its lr), fused into one kernel over every tensor where their device has
    it (CPU, CUDA)."""
    devices = {p.device.type for g in groups for p in g["params"]}
    return torch.optim.Adam(groups, fused=devices <= {"cpu", "cuda"} or None)


def _relative_error(module, forward, x, y, position_embeddings) -> float:
    """||forward(module, x) - y||^2 / ||y||^2 over one sequence x [1, T, D] (position embeddings [1, T, d])."""
    with torch.no_grad():
        out = forward(module, x, position_embeddings)
        return (out - y).pow(2).sum().item() / max(y.pow(2).sum().item(), 1e-30)


def refine_module(
    module: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    steps: int,
    lr: float,
    seq_len: int = SEQ_LEN,
    batch: int | None = None,
    seed: int = 0,
    forward=attention_output,
    slow: tuple[torch.nn.Parameter, ...] = (),
    slow_lr: float = 0.0,
    precision: str = "float32",
    queries: int = 0,
) -> dict:
    """Train `module` (float32, in place) so that forward(module, x) matches y (default: an MLAAttention's output), on
    the first `seq_len` tokens of `batch` (default: `batch_for(seq_len)`) random sequences of the first N-1 a step;
    the last sequence is held out (scored over its whole length). Adam with a cosine schedule on the relative squared
    error; the parameters in `slow` (e.g. a whole layer's MLP, whose source weights need only a correction) train at
    `slow_lr` and the others at `lr`; the steps compute in `precision` (float32 | bfloat16 autocast). With `queries`
(fewer than `seq_len`, a whole layer's `layer_update` where `subset_supported`), a step's loss is taken at that many
random positions of its windows (`layer_update_at`), every key still formed. Returns
    {"before", "after", "kept"}: the held-out relative errors, and whether
    the trained weights were kept (else `module` is restored)."""
    n, total, _ = x.shape
    held = slice(n - 1, n)  # with one sequence it is also the training sequence
    train = slice(0, max(n - 1, 1))
    before = _relative_error(module, forward, x[held], y[held], position_embeddings)
    record = {"before": before, "after": before, "kept": False}
    if before < EXACT or steps <= 0:
        return record
    saved = {k: v.detach().clone() for k, v in module.state_dict().items()}
    params = list(module.parameters())
    for p in params:
        p.requires_grad_(True)
    slow_ids = {id(p) for p in slow}
    groups = [{"params": [p for p in params if id(p) not in slow_ids], "lr": lr}]
    if slow:
        groups.append({"params": list(slow), "lr": slow_lr})
    optimizer = adam(groups)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    gen = torch.Generator().manual_seed(seed)
    seq_len = min(seq_len, total)
    batch = batch or batch_for(seq_len)
    xt, yt = x[train], y[train]
    cos, sin = position_embeddings
    pe = (cos[:, :seq_len].expand(batch, -1, -1), sin[:, :seq_len].expand(batch, -1, -1))
    scale = yt.pow(2).mean().clamp_min(1e-30)
    subset = bool(queries) and queries < seq_len and forward is layer_update and subset_supported(module)
    module.train()
    for _ in range(steps):
        rows = torch.randint(0, xt.shape[0], (batch,), generator=gen)
        xb, yb = xt[rows, :seq_len], yt[rows, :seq_len]
        with _compute(xb, precision):
            if subset:
                index = torch.randperm(seq_len, generator=gen)[:queries].sort().values.to(xb.device)
                out, yb = layer_update_at(module, xb, pe, index), yb[:, index]
            else:
                out = forward(module, xb, pe)
        loss = (out.float() - yb).pow(2).mean() / scale
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
    module.eval()
    for p in params:
        p.requires_grad_(False)
    after = _relative_error(module, forward, x[held], y[held], position_embeddings)
    record["after"] = after
    if after < before:
        record["kept"] = True
    else:
        module.load_state_dict(saved)
    return record
