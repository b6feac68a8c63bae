"""``algorithm.max_token_lag``: tokens of samples that lag the trainer too far leave the loss."""

from __future__ import annotations

import dataclasses

from postrl.types import ExperienceBatch


def mask_lagging_tokens(batch: ExperienceBatch, max_lag: int) -> tuple[ExperienceBatch, float]:
    """``algorithm.max_token_lag``: response tokens whose weights lag the trainer's by more than
    ``max_lag`` versions (``batch.token_lags``) leave the loss (they stay in the context); returns
    the batch and how many tokens were masked."""
    if batch.token_lags is None:
        raise ValueError("mask_lagging_tokens needs the batch's token_lags (ExperienceBatch.with_lags)")
    lagging = batch.token_lags > max_lag
    keep = (~lagging).to(batch.loss_mask.dtype)
    masked = float((batch.loss_mask * (1 - keep)).sum().item())
    return dataclasses.replace(batch, loss_mask=batch.loss_mask * keep), masked
