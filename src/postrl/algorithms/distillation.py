"""On-policy distillation as a per-token advantage: pure tensor functions.

The student samples ``y ~ pi_S``; the teacher scores each sampled token. The reverse KL
``KL(pi_S || pi_T)`` at a sampled token is estimated by ``log pi_S(y_t) - log pi_T(y_t)`` (k1), so
the per-token reward ``log pi_T(y_t) - log pi_S(y_t)`` is its negative: a policy gradient on it
moves the student toward the teacher on the student's own samples (GKD with lambda = 1; the
on-policy distillation recipes of Agarwal et al. 2024 and Thinking Machines 2025). Each token's
term is its own (no discounting over later tokens), as those recipes use it.
"""

from __future__ import annotations

import torch


def reverse_kl_advantage(
    student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor, weight: float = 1.0
) -> torch.Tensor:
    """``weight x (teacher - student)`` on the tokens of ``mask`` (``[B, T]``), 0 elsewhere; computed
    in float64 (the two logprobs are close, and their difference is what matters), returned as float32."""
    term = (teacher_logprobs.double() - student_logprobs.double()) * weight
    return torch.where(mask > 0, term, torch.zeros_like(term)).float()


def with_distillation(
    task_advantages: torch.Tensor | None, distill: torch.Tensor, taught: torch.Tensor
) -> torch.Tensor:
    """The advantage of each response token: the task's (``[B]``, broadcast over the response, or
    ``[B, T]``; None: distillation alone) plus the distillation term (``[B, T]``) on the rows a
    teacher scored (``taught``, ``[B]`` bool; the others keep the task's advantage alone)."""
    term = torch.where(taught.unsqueeze(1), distill, torch.zeros_like(distill))
    if task_advantages is None:
        return term
    task = task_advantages if task_advantages.dim() == 2 else task_advantages.unsqueeze(1).expand_as(term)
    return task.float() + term
