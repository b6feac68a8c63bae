"""What an environment hands back, checked before anything of it reaches a trajectory.

A message that is not a chat message (an unknown role, content that is neither text nor text
parts), a ``step`` that returns something other than a :class:`StepResult`, or a reward that is not
a finite number would otherwise be rendered into the tokens the model trains on, or fail somewhere
far from its cause. Each check raises :class:`EnvironmentOutputError` with the field at fault; the
episode then ends unscorable with that reason.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from postrl.rollout.agentic.env import StepResult

ROLES = ("system", "user", "assistant", "tool")


class EnvironmentOutputError(ValueError):
    """An environment returned something malformed; the message names the field."""


def check_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """``messages`` as a list of chat messages: each a dict with a ``role`` among :data:`ROLES` and a
    ``content`` that is a string or a list of ``{"type": "text", "text": str}`` parts."""
    if not isinstance(messages, list):
        raise EnvironmentOutputError(f"{where} must be a list of messages, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        field = f"{where}[{i}]"
        if not isinstance(message, dict):
            raise EnvironmentOutputError(f"{field} must be a dict with role and content, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise EnvironmentOutputError(f"{field}.role={role!r} is not a chat role ({', '.join(ROLES)})")
        _check_content(message.get("content"), f"{field}.content")
    return messages


def _check_content(content: Any, field: str) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise EnvironmentOutputError(
            f"{field} must be a string or a list of text parts, got {type(content).__name__} {content!r:.40}"
        )
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise EnvironmentOutputError(f'{field}[{j}] must be {{"type": "text", "text": "..."}}, got {part!r:.60}')


def check_step_result(result: Any) -> StepResult:
    """``result`` when it is a well-formed StepResult: messages, a finite numeric reward or None, a
    bool ``done`` and a dict ``info``."""
    if not isinstance(result, StepResult):
        raise EnvironmentOutputError(f"step() must return a StepResult, got {type(result).__name__} {result!r:.60}")
    check_messages(result.messages, "StepResult.messages")
    reward = result.reward
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
            raise EnvironmentOutputError(
                f"StepResult.reward must be a number or None, got {type(reward).__name__} {reward!r:.40}"
            )
        if not math.isfinite(reward):
            raise EnvironmentOutputError(f"StepResult.reward must be finite, got {reward}")
        result.reward = float(reward)
    if not isinstance(result.done, bool):
        raise EnvironmentOutputError(f"StepResult.done must be a bool, got {type(result.done).__name__}")
    if not isinstance(result.info, dict):
        raise EnvironmentOutputError(f"StepResult.info must be a dict, got {type(result.info).__name__}")
    return result
