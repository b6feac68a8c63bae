"""Continuing suspended rollouts: a sample an engine stopped mid-response (``finish_reason:
suspended``, when an async run's checkpoint asked) goes on from its prefix, on any engine.

The continuation's prompt is the original prompt plus the tokens sampled so far, token for token
(never re-tokenized text); its ``max_tokens`` is what the sample had left, so the budget counts
across the pause; the merged rollout keeps every earlier token, logprob and weight version and
appends the new ones. The prefix's K/V cache is prefilled anew by the weights the continuing
engine holds, so the new tokens' cache versions are those weights'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from postrl.types import Prompt, Rollout, SamplingParams, compact_versions

Generate = Callable[[list[Prompt], SamplingParams], list[Rollout]]


def suspended(rollouts: list[Rollout]) -> list[int]:
    """The positions of the rollouts an engine suspended."""
    return [i for i, r in enumerate(rollouts) if r.finish_reason == "suspended"]


def continue_rollouts(
    generate: Generate, prompts: list[Prompt], rollouts: list[Rollout], sampling: SamplingParams, tokenizer: Any
) -> list[Rollout]:
    """``rollouts`` with each suspended one continued to its end (one ``generate`` call per distinct
    remaining budget, n=1 per sample); the others as they were. A continuation may itself come back
    suspended (another checkpoint), and is continued again later."""
    out = list(rollouts)
    by_budget: dict[int, list[int]] = {}
    for i in suspended(rollouts):
        left = sampling.max_tokens - len(rollouts[i].response_ids)
        if left < 1:
            raise ValueError(f"a suspended rollout already holds max_tokens={sampling.max_tokens} tokens")
        by_budget.setdefault(left, []).append(i)
    for left, positions in sorted(by_budget.items()):
        asked = [_prefix_prompt(prompts[rollouts[i].prompt_index], rollouts[i]) for i in positions]
        answers = generate(asked, dataclasses.replace(sampling, n=1, max_tokens=left, seed=None))
        if len(answers) != len(positions):
            raise RuntimeError(f"the engine answered {len(answers)} continuations for {len(positions)} prompts")
        for answer in answers:
            i = positions[answer.prompt_index]
            out[i] = merged(rollouts[i], answer, tokenizer)
    return out


def _prefix_prompt(prompt: Prompt, partial: Rollout) -> Prompt:
    return dataclasses.replace(prompt, prompt_ids=list(partial.prompt_ids) + list(partial.response_ids))


def merged(partial: Rollout, rest: Rollout, tokenizer: Any) -> Rollout:
    """One rollout: ``partial``'s tokens then ``rest``'s (generated from ``partial``'s prefix)."""
    before, after = per_token_versions(partial), per_token_versions(rest)
    tokens = list(partial.response_ids) + list(rest.response_ids)
    oldest, own, cache = compact_versions(before[0] + after[0], before[1] + after[1], rest.weight_version)
    top = None
    if partial.top_logprobs is not None and rest.top_logprobs is not None:
        top = partial.top_logprobs + rest.top_logprobs
    return Rollout(
        prompt_index=partial.prompt_index,
        prompt_ids=list(partial.prompt_ids),
        response_ids=tokens,
        logprobs=list(partial.logprobs) + list(rest.logprobs),
        text=tokenizer.decode(tokens, skip_special_tokens=True),
        finish_reason=rest.finish_reason,
        weight_version=oldest,
        top_logprobs=top,
        logprob_versions=own,
        engine=rest.engine,
        kv_versions=cache,
    )


def per_token_versions(rollout: Rollout) -> tuple[list[int], list[int]]:
    """Each token's weight version and its cache's oldest version, spelled out."""
    n = len(rollout.response_ids)
    own = rollout.logprob_versions if rollout.logprob_versions is not None else [rollout.weight_version] * n
    cache = rollout.kv_versions if rollout.kv_versions is not None else list(own)
    return list(own), list(cache)
