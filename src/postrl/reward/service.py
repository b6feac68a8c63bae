"""The in-process Reward Service: verifiable + reward-model + format + length, mixed by weights.

``reward = alpha*verifiable + beta*model + gamma*format + delta*length`` (``reward.weights``).
The verifiable part runs in killable worker processes; when it raises, times out or returns
None the sample is *unscorable*: its reward is None, the error is kept, and the advantage
estimator leaves it out of its group.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from postrl.config import RewardConfig
from postrl.reward.pool import ScoringPool
from postrl.reward.rules import format_reward, length_penalty
from postrl.reward.verifiers import VERIFIERS
from postrl.types import RewardResult


@dataclass
class ScoreRequest:
    prompt: str
    response: str
    columns: dict[str, Any]
    response_tokens: int = 0


class RewardService:
    def __init__(self, config: RewardConfig) -> None:
        self.config = config
        self.weights = config.weights
        self.format_pattern = re.compile(config.format_pattern, re.DOTALL)
        kind = config.verifiable.type
        self.verifier_path = config.verifiable.function if kind == "custom" else VERIFIERS.get(kind)
        if self.verifier_path:
            _check_importable(self.verifier_path)
        self.pool = (
            ScoringPool(config.num_workers, config.timeout_s, preload=(self.verifier_path,)) if self.verifier_path else None
        )
        self.reward_model = None
        if config.model_path:
            from postrl.reward.reward_model import RewardModel

            self.reward_model = RewardModel(config.model_path)

    def score(self, prompt: str, response: str, **columns: Any) -> RewardResult:
        return self.score_batch([ScoreRequest(prompt, response, columns)])[0]

    def score_batch(self, requests: list[ScoreRequest]) -> list[RewardResult]:
        verifiable = self._verify(requests)
        model_scores = self.reward_model.score([(r.prompt, r.response) for r in requests]) if self.reward_model else None
        results = []
        for i, req in enumerate(requests):
            components: dict[str, float] = {}
            value, error = verifiable[i]
            if value is not None:
                components["verifiable"] = value
            if model_scores is not None:
                components["model"] = model_scores[i]
            components["format"] = format_reward(self.format_pattern, req.response)
            components["length"] = length_penalty(req.response_tokens, self.config.length_target_tokens)
            if error is not None:
                results.append(RewardResult(reward=None, components=components, error=error))
                continue
            total = sum(getattr(self.weights, name) * v for name, v in components.items())
            results.append(RewardResult(reward=total, components=components))
        return results

    def _verify(self, requests: list[ScoreRequest]) -> list[tuple[float | None, str | None]]:
        if self.pool is None:
            return [(None, None)] * len(requests)
        options = {"answer_column": self.config.verifiable.answer_column}
        if self.config.verifiable.type == "custom":
            options = {}
        jobs = [
            {"fn": self.verifier_path, "prompt": r.prompt, "response": r.response, "columns": r.columns, "options": options}
            for r in requests
        ]
        return [(res.value, res.error) for res in self.pool.map(jobs)]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def _check_importable(path: str) -> None:
    """Fail at start-up, not at the first step, when the reward function cannot be imported."""
    import importlib

    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward function '{path}': cannot import module '{module_name}': {exc}") from None
    if not callable(getattr(module, attr, None)):
        raise ValueError(f"reward function '{path}': module '{module_name}' has no callable '{attr}'")
