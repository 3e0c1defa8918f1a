"""Local refinement of a converted attention layer (`--refine-steps`): after the closed-form factorization, the MLA
attention's weights are trained by gradient descent so that its output (after o_proj) matches the source attention's
on the calibration activations, through the real softmax and RoPE.

The closed form minimizes a quadratic proxy (K/V error under input statistics); the rank and RoPE truncation it leaves
behind is a nonlinear error in attention outputs. This step measures that error directly and reduces it, layer by
layer, without labels or a data set: inputs and targets are the calibration text's hidden states (the source's own
sampled text by default). Shapes do not change (the cache and the serving formats are untouched).

Safeguards: one calibration sequence is held out; the refined weights are kept only if they lower its error (a layer
that the closed form already reproduces, e.g. at full rank, has nothing to gain: it is left bit-exact).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os

import torch

from mla_convert import dtypes, policy
from mla_convert.errors import UserError
from mla_convert.schema import DEFAULTS, choices

log = logging.getLogger(__name__)

EXACT = 1e-9  # relative error below which a layer is already exact (float32 round-off): not refined
# Adam (cosine) on one 2048-token window a step, so that training reaches the positions a 2048-token context holds;
# chosen on the development split: docs/decisions.md#refinement-steps-rate-and-window.
# Windows start at each sequence's first token: crops that start mid-sequence put the attention sink on an arbitrary
# token and train the layer on a pattern it never meets. The steps by the cache kept: mla_convert.policy.
DEFAULT_STEPS, WIDE_STEPS = policy.REFINE_STEPS
DEFAULT_LR = DEFAULTS["refine_lr"]  # the options' defaults: mla_convert/schema.py
STEP_TOKENS = 2048  # tokens a step: a shorter window (`--refine-seq-len`) takes more sequences a step
SEQ_LEN = DEFAULTS["refine_seq_len"]
BATCH = STEP_TOKENS // SEQ_LEN
# `--refine-steps auto` refines on a GPU, and on the CPU when the estimate below is at most AUTO_CPU_SECONDS: the
# embedded model at both budgets, not an 8B model (hours). CPU_FLOPS: what 2 CPU cores without bfloat16 arithmetic
# sustain in the refinement's float32 steps (the steps `auto` runs there); CPU_BF16_FLOPS: what 2 cores with AMX
# sustain in its bfloat16 steps, CPU_AVX512_BF16_FLOPS what 2 cores with AVX512-BF16 but no AMX sustain in them;
# CPU_BF16_MODEL_FLOPS: what 2 cores with AMX sustain in the model stage's bfloat16 steps, whose whole-model matrix
# products (the head's above all) AMX speeds more than the layer step's attention; SUBSET_RATE: the share of the rate
# a step at chosen positions (`--refine-queries`) sustains. Measured on whole conversions
# (docs/decisions.md#time-estimate-and-when-auto-refines-on-a-cpu).
CPU_FLOPS = 1.5e11
CPU_BF16_FLOPS = 4.1e11
CPU_BF16_MODEL_FLOPS = 4.6e11
CPU_AVX512_BF16_FLOPS = 2.1e11
SUBSET_RATE = 0.5
# Those rates are the 2-core reference machine's; another CPU's are scaled by its speed relative to it (`cpu_speed`):
# its thread count over REFERENCE_THREADS, or $MLA_CONVERT_CPU_SPEED where set
# (docs/decisions.md#time-estimate-and-when-auto-refines-on-a-cpu).
REFERENCE_THREADS = 2
CPU_SPEED_ENV = "MLA_CONVERT_CPU_SPEED"
# attention: train the converted attention to the source attention's outputs. layer: train the whole converted decoder
# layer (attention, MLP, norms) to what the source layer adds to the residual stream, so that the MLP can also take
# back what the attention lost. MLP_LR_SCALE (`--refine-mlp-lr-scale`): the MLP's and norms' learning rate / the
# attention's. Both chosen on the development split: docs/decisions.md#refinement-scope-and-the-mlps-rate.
SCOPES = choices("refine_scope")
DEFAULT_SCOPE = DEFAULTS["refine_scope"]
MLP_LR_SCALE = DEFAULTS["refine_mlp_lr_scale"]
AUTO_CPU_SECONDS = 5400
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


def cpu_rate(precision: str, model_stage: bool = False) -> float:
    """The flop/s the estimates assume on this machine's CPU for steps computed in `precision` (float32 |
    bfloat16: AMX tiles where the CPU has them, else its AVX512-BF16 instructions; on a CPU with neither, bfloat16 is
    emulated, not measured, and estimated at the float32 rate), the model stage's steps with `model_stage`, scaled by
    its `cpu_speed`."""
    if precision != "bfloat16":
        rate = CPU_FLOPS
    elif torch.cpu._is_amx_tile_supported():
        rate = CPU_BF16_MODEL_FLOPS if model_stage else CPU_BF16_FLOPS
    else:
        rate = CPU_AVX512_BF16_FLOPS if torch.cpu._is_avx512_bf16_supported() else CPU_FLOPS
    return rate * cpu_speed()


def cpu_speed() -> float:
    """This CPU's speed relative to the 2-core machine the estimates' rates were fitted on: $MLA_CONVERT_CPU_SPEED
    where set (a positive number), else torch's thread count over REFERENCE_THREADS (each core as fast as the
    reference's)."""
    text = _speed_setting()
    if not text:
        return torch.get_num_threads() / REFERENCE_THREADS
    try:
        speed = float(text)
    except ValueError:
        speed = math.nan
    if not (math.isfinite(speed) and speed > 0):
        raise UserError(f"{CPU_SPEED_ENV}={text!r}: set it to a positive number (this CPU's speed relative to the "
                        "2-core machine the time estimates assume, 2 for twice as fast), or unset it")
    return speed


def cpu_speed_source() -> str:
    """Where `cpu_speed` comes from, for the plan's time line: the user's setting, or the thread count."""
    text, threads = _speed_setting(), torch.get_num_threads()
    return f"{CPU_SPEED_ENV}={text}" if text else f"{threads} thread{'s' * (threads != 1)}"


def _speed_setting() -> str:
    """$MLA_CONVERT_CPU_SPEED as the user set it ("" where unset)."""
    return os.environ.get(CPU_SPEED_ENV, "").strip()


def _compute(x: torch.Tensor, precision: str):
    """The context the training forwards run in: bfloat16 autocast on x's device, or nothing for float32."""
    return torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=precision == "bfloat16")


def step_flops(plan, seq_len: int = SEQ_LEN, batch: int = BATCH, whole: bool | None = None,
               queries: int | None = None) -> float:
    """Forward + backward flops of one refinement step of one layer: the projections (2 x tokens x parameters, the
    MLP's too where the whole layer runs: `whole`, by default where it trains) and the score and value products over
    causal windows, both x3 for the backward pass. With `queries` (fewer than `seq_len`: `layer_update_at`) only the
    key side (kv_a and kv_b) runs at every position; the rest, and the scores (each chosen query against the whole
    window, masked), at the chosen positions."""
    params = plan.attn_params_after / plan.layers
    if plan.refine_scope == "layer" if whole is None else whole:  # a gated MLP: three hidden x intermediate maps
        params += 3 * plan.hidden * plan.memory.get("intermediate", 4 * plan.hidden)
    width = plan.nope_dims + plan.rope_dims + plan.head_dim  # q.k and p.v per score
    if not queries or queries >= seq_len:
        return 3 * (2 * batch * seq_len * params + 2 * batch * plan.heads * seq_len**2 * width)
    ranks = plan.kv_lora_rank
    keys = sum((r + plan.rope_dims) * plan.hidden + plan.groups * (plan.nope_dims + plan.head_dim) * r
               for r in ranks) / len(ranks)
    linear = 2 * batch * (seq_len * keys + queries * (params - keys))
    return 3 * (linear + 2 * batch * plan.heads * queries * seq_len * width)


def resolve_queries(requested: int | None, seq_len: int, kept: float = 1.0, device: str = "cpu") -> int:
    """Positions of a window a step takes its loss at (`refine_module`'s `queries`): `requested`, or (None, auto)
    `policy.REFINE_QUERIES_CPU` by the cache `kept` on a CPU and every position on a GPU; 0 (every position) where
    that is the whole window anyway."""
    if requested is None:
        requested = policy.by_cache_kept(kept, policy.REFINE_QUERIES_CPU) if device.startswith("cpu") else 0
    return requested if requested < seq_len else 0


def batch_for(seq_len: int) -> int:
    """Sequences a step for windows of `seq_len` tokens: STEP_TOKENS a step (at least one sequence)."""
    return max(1, STEP_TOKENS // seq_len)


def estimate_seconds(plan, steps: int, seq_len: int = SEQ_LEN, rate: float = CPU_FLOPS,
                     queries: int | None = None) -> float:
    """`steps` per layer at `rate` flop/s over windows of `seq_len` tokens (the refinement window, as trained), at
    `queries` positions of each (`step_flops`, at SUBSET_RATE of `rate`)."""
    if queries and queries < seq_len:
        rate *= SUBSET_RATE
    return steps * plan.layers * step_flops(plan, seq_len, batch_for(seq_len), queries=queries) / rate


def default_steps(kept: float, device: str = "cuda", queries: int = 0) -> int:
    """The auto refinement steps per layer of a conversion that keeps `kept` (a fraction) of the source's KV cache:
    `policy.REFINE_STEPS_CPU` on a CPU whose steps take `queries` positions of a window (the trade that pair was
    measured for), else `policy.REFINE_STEPS` (a GPU's, and every position's)."""
    subset = device.startswith("cpu") and queries > 0
    return policy.by_cache_kept(kept, policy.REFINE_STEPS_CPU if subset else policy.REFINE_STEPS)


def resolve_steps(requested: int | None, plan, device: str, seq_len: int, rate: float = CPU_FLOPS,
                  queries: int = 0) -> int:
    """The refinement steps per layer: `requested`, or (None, auto) `default_steps` of the cache kept on a GPU or
    where the CPU estimate (steps at `queries` positions) is at most AUTO_CPU_SECONDS, else 0 (with a warning that
    says what refining would cost)."""
    if requested is not None:
        return requested
    steps = default_steps(plan.ratio, device, queries)
    if not device.startswith("cpu"):
        return steps
    seconds = estimate_seconds(plan, steps, seq_len, rate, queries)
    if seconds <= AUTO_CPU_SECONDS:
        return steps
    log.warning("not refining the converted layers: on this CPU it would take about %.1f h (estimate); pass "
                "--refine-steps %d to refine anyway, or convert with --device cuda", seconds / 3600, steps)
    return 0


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
    from mla_convert.calibration import layer_mask

    mask = layer_mask(attn, x.shape[1], x.device)
    return attn(x, position_embeddings=position_embeddings, attention_mask=mask)[0]


def layer_update(layer, x, position_embeddings) -> torch.Tensor:
    """What a decoder layer adds to the residual stream x (attention and MLP): layer(x) - x."""
    from mla_convert.calibration import layer_mask

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


# The model stage (`--refine-model-steps`): after every layer is converted (and refined), the converted model's
# attention is trained end to end so that its next-token distributions match the source's on the same calibration
# windows: KL(source || converted) per token. Layer-wise targets cannot see how the errors of successive layers
# compound; the source's own output distribution can. It reads no other text (the calibration windows, one held out),
# and needs the source's final hidden states only, which the calibration stream already computed: no second model.
# Steps and rate chosen on the development split: docs/decisions.md#the-model-stage. MODEL_STEPS on a GPU; on a CPU
# `policy.MODEL_STEPS_CPU` by the cache kept (fewer, for time: docs/decisions.md#the-model-stage-on-a-cpu). MODEL_LR
# for a stage of MODEL_STEPS or more steps, SHORT_MODEL_LR for a shorter one.
MODEL_STEPS = 64
MODEL_LR = 1e-4
SHORT_MODEL_LR = 2e-4
MODEL_WARMUP = 0.1  # of the steps, linear, then cosine to zero
LOGIT_CHUNK = 512  # positions whose logits are formed at once: memory does not grow with vocabulary x window
MODEL_CHECKS = 8  # held-out evaluations during the stage: the best weights seen are kept (early stopping)
# positions of a step's window whose KL the stage trains on, drawn at random each step (0: every position): the head
# and its log-softmaxes over the vocabulary run at those alone, the layers still at every position
MODEL_POSITIONS = 0
# what the stage trains: every converted attention, or every decoder layer whole (attention, MLP, norms; embeddings,
# the final norm and the head stay the source's either way)
MODEL_SCOPES = choices("refine_model_scope")
MODEL_SCOPE = DEFAULTS["refine_model_scope"]


AUTO_MODEL_CPU_SECONDS = 1800  # `--refine-model-steps auto` on the CPU: at most this estimate (see resolve_model_steps)


def model_step_flops(plan, seq_len: int = SEQ_LEN, positions: int | None = None) -> float:
    """Forward + backward flops of one model-stage step: every layer (attention and MLP) on one window of `seq_len`
    tokens and the head at `positions` of them (default MODEL_POSITIONS; 0: all): the student's logits and their
    gradient (the teacher's side is formed once, `teacher_terms`)."""
    positions = MODEL_POSITIONS if positions is None else positions
    at = positions if 0 < positions < seq_len else seq_len
    return plan.layers * step_flops(plan, seq_len, 1, whole=True) + 2 * _head_flops(plan, at)


def _head_flops(plan, positions: int) -> float:
    """Flops of the head's logits at `positions`."""
    return 2 * positions * plan.hidden * plan.memory.get("vocab", 0)


def estimate_model_seconds(plan, steps: int, seq_len: int = SEQ_LEN, rate: float = CPU_FLOPS) -> float:
    """The model stage's `steps` at `rate` flop/s, with its held-out passes (a forward at every position, about a
    third of such a step: one before training and about MODEL_CHECKS during it, one a step where the stage is
    shorter) and the teacher's terms of the windows it reads (`teacher_terms`: its logits and their expected head
    row, float32; the held-out window and at most one more a step); 0 without steps."""
    if not steps:
        return 0.0
    checks = (min(steps, MODEL_CHECKS) + 1) / 3 * model_step_flops(plan, seq_len, 0)
    windows = min(plan.memory.get("samples", 0), steps + 1)  # the held-out window and those the steps draw
    terms = windows * 2 * _head_flops(plan, seq_len) / cpu_rate("float32")
    return (steps * model_step_flops(plan, seq_len) + checks) / rate + terms


def resolve_model_steps(requested: int | None, plan, device: str, seq_len: int, rate: float = CPU_FLOPS) -> int:
    """The model stage's steps: `requested`, or (None, auto) MODEL_STEPS on a GPU; on a CPU `policy.MODEL_STEPS_CPU`
    by the cache kept where their estimate is at most AUTO_MODEL_CPU_SECONDS and the model stage's memory
    (`model_stage_bytes`) at most half the machine's, else 0 (with a warning that says why; none where the CPU's
    default is 0 steps)."""
    if requested is not None:
        return requested
    if not device.startswith("cpu"):
        return MODEL_STEPS
    steps = policy.by_cache_kept(plan.ratio, policy.MODEL_STEPS_CPU)
    if not steps:
        return 0
    seconds = estimate_model_seconds(plan, steps, seq_len, rate)
    needed, total = model_stage_bytes(plan, seq_len), machine_bytes()
    if seconds <= AUTO_MODEL_CPU_SECONDS and (total is None or needed <= total / 2):
        return steps
    log.warning("no model stage: on this CPU it would take about %.1f h and %.1f GiB (estimates); pass "
                "--refine-model-steps %d to run it anyway, or convert with --device cuda", seconds / 3600,
                needed / 2**30, steps)
    return 0


def resolve_model_lr(requested: float | None, steps: int) -> float:
    """The model stage's rate: `requested`, or (None, auto) MODEL_LR for a stage of MODEL_STEPS or more steps and
    SHORT_MODEL_LR for a shorter one."""
    if requested is not None:
        return requested
    return MODEL_LR if steps >= MODEL_STEPS else SHORT_MODEL_LR


def model_stage_bytes(plan, seq_len: int = SEQ_LEN, scope: str = MODEL_SCOPE) -> int:
    """Resident bytes of the model stage beyond the calibration hidden states: the whole converted model in float32,
    the trained tensors' gradients, Adam moments and best copy (`scope`: the attention's or the whole layers', 4 more
    copies), the saved activations of one window (about 16 hidden and 4 intermediate floats a token per layer, with
    the attention's score rows for one head at a time) and the logits of LOGIT_CHUNK positions (the student's, its
    distribution and gradient; the teacher's side is `teacher_terms`, the size of its hidden states)."""
    inter, vocab = plan.memory.get("intermediate", 4 * plan.hidden), plan.memory.get("vocab", 0)
    layers = plan.attn_params_after + plan.layers * (3 * plan.hidden * inter + 2 * plan.hidden)
    trained = layers if scope == "layer" else plan.attn_params_after
    acts = plan.layers * seq_len * (16 * plan.hidden + 4 * inter) * 4 + seq_len * seq_len * 4 * 2
    return 4 * (layers + vocab * plan.hidden) + 16 * trained + acts + 5 * min(LOGIT_CHUNK, seq_len) * vocab * 4


def machine_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def teacher_terms(model, teacher: torch.Tensor) -> torch.Tensor:
    """What the KL to the teacher needs of it, formed once: `teacher` [..., T, D] (the source's final normed hidden
    states) -> [..., T, D + 1] float32, each position's expected head row under the teacher's distribution p (W^T p)
    and, last, the constant sum_v p_v (log p_v - b_v) (b: the head's bias, if any). For student logits s = W h + b,
    KL(p || softmax(s)) = that constant - h . W^T p + logsumexp(s): a step then forms only the student's logits."""
    head = model.get_output_embeddings()
    weight, bias = head.weight.float(), None if head.bias is None else head.bias.float()
    flat = teacher.reshape(-1, teacher.shape[-1])
    terms = torch.empty(flat.shape[0], flat.shape[1] + 1, dtype=torch.float32, device=flat.device)
    with torch.no_grad():
        for start in range(0, flat.shape[0], LOGIT_CHUNK):
            logits = torch.nn.functional.linear(flat[start : start + LOGIT_CHUNK].float(), weight, bias)
            logp = torch.log_softmax(logits, dim=-1)
            p = logp.exp()
            constant = (p * (logp if bias is None else logp - bias)).sum(-1)
            terms[start : start + LOGIT_CHUNK, :-1] = p @ weight
            terms[start : start + LOGIT_CHUNK, -1] = constant
    return terms.view(*teacher.shape[:-1], -1)


def _kl_chunks(model, hidden, terms, backward: bool, precision: str = "float32") -> float:
    """Sum over positions of KL(teacher || softmax(lm_head(hidden))), hidden [T, D] (after the final norm) and the
    teacher's `teacher_terms` [T, D + 1]; the logits of LOGIT_CHUNK positions at a time, their products in `precision`
    (log-sum-exp and KL in float32). With `backward`, the gradient of the mean is written into hidden.grad (hidden: a
    leaf), formed directly: the head is frozen, and d KL / d h = W^T softmax(s) - W^T p."""
    head = model.get_output_embeddings()
    dtype = torch.bfloat16 if precision == "bfloat16" else torch.float32
    weight = head.weight.detach().to(dtype)
    bias = None if head.bias is None else head.bias.detach().to(dtype)
    if backward:
        hidden.grad = torch.empty_like(hidden)  # every chunk's rows written below
    total = 0.0
    count = hidden.shape[0]
    with torch.no_grad():
        for start in range(0, count, LOGIT_CHUNK):
            h, t = hidden[start : start + LOGIT_CHUNK].detach(), terms[start : start + LOGIT_CHUNK]
            logits = torch.nn.functional.linear(h.to(dtype), weight, bias).float()
            normalizer = torch.logsumexp(logits, dim=-1)
            total += (normalizer - (h.float() * t[:, :-1]).sum(-1) + t[:, -1]).sum().item()
            if backward:
                q = logits.sub_(normalizer[:, None]).exp_()  # the student's distribution, in the logits' storage
                grad = (q.to(dtype) @ weight).float() - t[:, :-1]
                hidden.grad[start : start + LOGIT_CHUNK] = (grad / count).to(hidden.dtype)
    return total


def model_kl(model, tokens: torch.Tensor, teacher: torch.Tensor, below: torch.Tensor | None = None,
             first: int = 0) -> float:
    """Mean per-token KL(source || model) over windows `tokens` [N, T] whose source final normed hidden states are
    `teacher` [N, T, D]; with `below` [N, T, D], the inputs of the model's layer `first` (`frozen_outputs`), the
    model runs from there."""
    return _terms_kl(model, tokens, teacher_terms(model, teacher), below, first)


def _terms_kl(model, tokens: torch.Tensor, terms: torch.Tensor, below: torch.Tensor | None, first: int) -> float:
    """`model_kl` from the teacher's `teacher_terms` [N, T, D + 1], formed beforehand."""
    total = 0.0
    with torch.no_grad():
        for i, (ids, t) in enumerate(zip(tokens, terms)):
            hidden = final_hidden(model, ids, None if below is None else below[i], first)
            total += _kl_chunks(model, hidden, t, backward=False)
    return total / tokens.numel()


@contextlib.contextmanager
def _layers(model, part: slice, norm: bool = True):
    """`model`'s decoder with only its layers `part` (and no final norm unless `norm`) for the time of the block."""
    inner = model.model
    layers, final = inner.layers, inner.norm
    inner.layers = torch.nn.ModuleList(list(layers)[part])
    if not norm:
        inner.norm = torch.nn.Identity()
    try:
        yield inner
    finally:
        inner.layers, inner.norm = layers, final


def frozen_outputs(model, tokens: torch.Tensor, first: int) -> torch.Tensor | None:
    """The inputs of decoder layer `first` on windows `tokens` [N, T] ([N, T, D]; None for 0): what the layers below
    give, computed once where the model stage trains only the layers from `first` on."""
    if first <= 0:
        return None
    with torch.no_grad(), _layers(model, slice(0, first), norm=False) as bottom:
        return torch.cat([bottom(input_ids=ids[None], use_cache=False).last_hidden_state for ids in tokens])


def final_hidden(model, ids: torch.Tensor, below: torch.Tensor | None = None, first: int = 0) -> torch.Tensor:
    """The model's last hidden states after its final norm [T, D] on one window `ids` [T]; where `below` [T', D] (T'
    >= T: the inputs of layer `first`, `frozen_outputs`) is given, through the layers from `first` on only."""
    if below is None:
        return model.model(input_ids=ids[None], use_cache=False).last_hidden_state[0]
    with _layers(model, slice(first, None)) as top:
        return top(inputs_embeds=below[None, : ids.shape[0]], use_cache=False).last_hidden_state[0]


def first_trained(model, top: int | None) -> int:
    """The first decoder layer the model stage trains when it trains the last `top` (None: every layer)."""
    layers = len(model.model.layers)
    if top is None:
        return 0
    if not 1 <= top <= layers:
        raise ValueError(f"the model stage trains the last 1 to {layers} layers, got top={top}")
    return layers - top


def model_parameter_names(model, scope: str = MODEL_SCOPE, top: int | None = None) -> list[str]:
    """What the model stage trains: every attention's weights (`attention`: what the conversion changed) or every
    decoder layer's (`layer`: attention, MLP and norms), of the last `top` decoder layers only where given (the
    backward then stops below them); embeddings, the final norm and the head stay as they are."""
    if scope not in MODEL_SCOPES:
        raise ValueError(f"model stage scope must be one of {MODEL_SCOPES}, got {scope!r}")
    marker = ".self_attn." if scope == "attention" else ".layers."
    first = first_trained(model, top)
    return [name for name, _ in model.named_parameters()
            if marker in name and int(name.split(".layers.", 1)[1].split(".", 1)[0]) >= first]


@torch.no_grad()
def _copy(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Each tensor of `targets` takes the values of its peer in `sources`."""
    for t, s in zip(targets, sources):
        t.copy_(s)


def refine_model(model, tokens: torch.Tensor, teacher: torch.Tensor, steps: int, lr: float = MODEL_LR,
                 seq_len: int = SEQ_LEN, seed: int = 0, scope: str = MODEL_SCOPE, precision: str = "float32",
                 top: int | None = None, positions: int | None = None) -> dict:
    """Train `model`'s attention (`scope` layer: its whole decoder layers; float32, in place) end to end so that its
    next-token distributions match the source's: `teacher` [N, T, D] holds the source's final hidden states after its
    final norm on the calibration windows `tokens` [N, T] (its logits are the model's own head applied to them: the head
    is not trained). Adam, a linear warmup then cosine; a step trains on one window's first `seq_len` tokens, drawn
    from all but the last window (held out), at `positions` random positions of them (default MODEL_POSITIONS; 0: all)
    and computes in `precision`. The held-out KL (float32, every position) is measured every steps // MODEL_CHECKS
    steps and after the final one; the best weights seen are what the model keeps: the converted
    weights themselves where no check improved on them. With `top`, only the last `top` decoder layers train: the
    layers below are frozen, their outputs computed once a window (`frozen_outputs`), and a step runs the top ones.

    Returns {"before", "after", "kept", "step", "last", "curve"}: the held-out mean KL before and of the weights
    kept, whether trained weights were kept and after which step (0: none), the KL after the last step, and every
    check as [step, KL]."""
    n, positions = tokens.shape[0], MODEL_POSITIONS if positions is None else positions
    held, train = slice(n - 1, n), slice(0, max(n - 1, 1))
    first = first_trained(model, top) if steps > 0 else 0
    below = frozen_outputs(model, tokens, first)
    bt, bh = (None, None) if below is None else (below[train], below[held])
    held_terms = teacher_terms(model, teacher[held])  # the teacher's head is formed here, once a window
    before = _terms_kl(model, tokens[held], held_terms, bh, first)
    record = {"before": before, "after": before, "kept": False, "step": 0, "last": before, "curve": []}
    if steps <= 0 or before < EXACT:
        return record
    names = set(model_parameter_names(model, scope, top))
    params = [p for name, p in model.named_parameters() if name in names]
    best = [p.detach().clone() for p in params]  # the weights with the lowest held-out KL so far
    frozen = [p for p in model.parameters() if p.requires_grad]
    model.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    optimizer = adam([{"params": params, "lr": lr}])
    warmup, every = max(1, int(MODEL_WARMUP * steps)), max(1, steps // MODEL_CHECKS)

    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / (warmup + 1)
        return 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    gen, picks = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)  # windows, positions
    xt = tokens[train]
    terms = functools.cache(lambda row: teacher_terms(model, teacher[row]))  # formed when a step first draws the window
    seq_len = min(seq_len, tokens.shape[1])
    for step in range(1, steps + 1):
        model.train()
        row = int(torch.randint(0, xt.shape[0], (1,), generator=gen))
        ids, target = xt[row, :seq_len], terms(row)[:seq_len]
        with _compute(ids, precision):
            hidden = final_hidden(model, ids, None if bt is None else bt[row], first)
        if 0 < positions < seq_len:
            at = torch.randperm(seq_len, generator=picks)[:positions].sort().values.to(hidden.device)
            hidden, target = hidden[at], target[at]
        leaf = hidden.detach().float().requires_grad_(True)
        loss = _kl_chunks(model, leaf, target, backward=True, precision=precision) / leaf.shape[0]
        optimizer.zero_grad(set_to_none=True)
        hidden.backward(leaf.grad.to(hidden.dtype))
        optimizer.step()
        schedule.step()
        log.info("refine model: step %d/%d KL %.4f", step, steps, loss)
        if step % every and step != steps:
            continue
        model.eval()
        kl = _terms_kl(model, tokens[held], held_terms, bh, first)
        record["curve"].append([step, kl])
        log.info("refine model: held-out KL %.4f after step %d (before %.4f)", kl, step, before)
        if kl < record["after"]:
            record.update(after=kl, kept=True, step=step)
            _copy(best, params)
    record["last"] = record["curve"][-1][1]
    model.eval()
    optimizer.zero_grad(set_to_none=True)
    for p in params:
        p.requires_grad_(False)
    for p in frozen:
        p.requires_grad_(True)
    _copy(params, best)
    return record
