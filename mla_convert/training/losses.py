"""The fine-tuning losses: next-token cross-entropy and distillation."""

from __future__ import annotations

import torch


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy. logits [B, T, V], ids [B, T]."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 * mean over tokens of KL(teacher_T || student_T). Both [B, T, V]."""
    s = torch.log_softmax(student_logits.float() / temperature, dim=-1)  # [B, T, V]
    t = torch.log_softmax(teacher_logits.float() / temperature, dim=-1)  # [B, T, V]
    kl = torch.nn.functional.kl_div(s.flatten(0, 1), t.flatten(0, 1), log_target=True, reduction="batchmean")
    return kl * temperature**2
