"""Cheap rule rewards computed in the driver: format (regex), length penalty, DAPO's overlong shaping."""

from __future__ import annotations

import re


def format_reward(pattern: re.Pattern[str], response: str) -> float:
    """1.0 when the whole response matches the configured pattern."""
    return 1.0 if pattern.fullmatch(response) else 0.0


def length_penalty(num_tokens: int, target_tokens: int) -> float:
    """0 up to ``target_tokens``, then -(excess / target): -1 at twice the target."""
    if target_tokens <= 0:
        return 0.0
    return -max(0, num_tokens - target_tokens) / target_tokens


def overlong_penalty(num_tokens: int, max_tokens: int, cache_tokens: int) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025): 0 up to ``max_tokens - cache_tokens``, then
    falling linearly to -1 at ``max_tokens``, and -1 beyond."""
    start = max_tokens - cache_tokens
    if num_tokens <= start:
        return 0.0
    if num_tokens > max_tokens:
        return -1.0
    return (start - num_tokens) / cache_tokens
