"""What the Reward Service is asked to score of a rollout: one place, for training, validation
and ``postrl eval``."""

from __future__ import annotations

from postrl.reward.client import RewardServiceError
from postrl.types import Prompt, RewardResult, Rollout, ScoreRequest
from postrl.workers.roles import RewardService


def score_requests(prompts: list[Prompt], rollouts: list[Rollout]) -> list[ScoreRequest]:
    """One request per rollout, in order: its prompt and response, with the prompt's columns; an
    episode's (``agent:`` runs) response is its transcript, and its messages and the environment's
    info join the columns (``messages``, ``env_info``)."""
    out = []
    for r in rollouts:
        p = prompts[r.prompt_index]
        if r.episode is None:
            out.append(ScoreRequest(p.text, r.text, p.columns, len(r.response_ids)))
        else:
            columns = {**p.columns, "messages": r.episode.messages, "env_info": r.episode.info}
            out.append(ScoreRequest(p.text, r.episode.transcript(), columns, len(r.response_ids)))
    return out


def score_with(reward: RewardService, prompts: list[Prompt], rollouts: list[Rollout]) -> list[RewardResult]:
    """The Reward Service's results; a failed service makes every sample unscorable with its error."""
    try:
        return reward.score_batch(score_requests(prompts, rollouts))
    except RewardServiceError as exc:
        return [RewardResult(reward=None, error=str(exc)) for _ in rollouts]
