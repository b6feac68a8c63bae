"""Every call an engine answers, kept to check recorded trajectories against: a trajectory is token
exact when each of its trained spans is exactly the response of an engine call whose prompt is
exactly the trajectory before that span (benchmarks/agentic.py, agent_learning.py and the tests)."""

from __future__ import annotations

from typing import Any

Calls = list[tuple[list[int], list[int]]]


def log_calls(engine: Any) -> Calls:
    """The list every ``engine.generate`` call's (prompt ids, response ids) are appended to."""
    calls: Calls = []
    generate = engine.generate

    def logged(prompts, sampling_params, weight_version, on_token=None):
        out = generate(prompts, sampling_params, weight_version, on_token)
        calls.extend((list(r.prompt_ids), list(r.response_ids)) for r in out)
        return out

    engine.generate = logged
    return calls


def trained_spans(rollout: Any) -> list[tuple[int, int]]:
    """(start, end) in prompt + response of each run of trained (loss mask 1) tokens."""
    mask = [0] * len(rollout.prompt_ids) + list(rollout.loss_mask or [1] * len(rollout.response_ids))
    spans, i = [], len(rollout.prompt_ids)
    while i < len(mask):
        if not mask[i]:
            i += 1
            continue
        end = i
        while end < len(mask) and mask[end]:
            end += 1
        spans.append((i, end))
        i = end
    return spans


def exactly_engine_calls(rollout: Any, calls: Calls) -> bool:
    """Whether every trained span is an engine call's response to exactly the tokens before it."""
    full = rollout.prompt_ids + rollout.response_ids
    by_prompt = {tuple(p): g for p, g in calls}
    return all(by_prompt.get(tuple(full[:i])) == full[i:end] for i, end in trained_spans(rollout))
