"""A batch between generation and scoring, and its checkpoint form."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from postrl.types import Prompt, Rollout
from postrl.types.episode import episode_of_state


@dataclass(frozen=True)
class Generated:
    """A batch between generation and scoring: its number in the run, prompts and rollouts. Some
    rollouts may be ``suspended`` (an async run's checkpoint stopped the engines mid-batch): the
    batch is continued by its source before scoring (a response from its prefix, an episode from
    its saved state)."""

    number: int
    prompts: list[Prompt]
    rollouts: list[Rollout]
    generated_at: float

    @property
    def suspended(self) -> bool:
        return any(r.finish_reason == "suspended" for r in self.rollouts)

    def state_dict(self) -> dict[str, Any]:
        """Plain lists and dicts (a checkpoint loads with ``weights_only``)."""
        return {
            "number": self.number,
            "prompts": [asdict(p) for p in self.prompts],
            "rollouts": [asdict(r) for r in self.rollouts],
            "generated_at": self.generated_at,
        }

    @staticmethod
    def of_state(state: dict[str, Any]) -> Generated:
        return Generated(
            int(state["number"]),
            [Prompt(**p) for p in state["prompts"]],
            [rollout_of_state(r) for r in state["rollouts"]],
            float(state["generated_at"]),
        )


def rollout_of_state(state: dict[str, Any]) -> Rollout:
    """A Rollout from its plain form, its episode (and a suspended episode's saved state) rebuilt."""
    episode = state.get("episode")
    return Rollout(**{**state, "episode": None if episode is None else episode_of_state(episode)})
