"""The failure-rate limit of a step (``reward.max_failure_rate``): too many samples that could not
be scored, whether their reward function, the reward service, their environment or their agent
function failed, stop the run with the most common reasons and the step's samples saved."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from postrl.controller.step_metrics import write_samples
from postrl.types import Prompt, RewardResult, Rollout


class RewardFailureError(RuntimeError):
    """Too many samples of a step could not be scored (reward.max_failure_rate)."""


def check_failure_rate(
    run_dir: Path, step: int, limit: float, prompts: list[Prompt], rollouts: list[Rollout], rewards: list[RewardResult]
) -> None:
    """Raise :class:`RewardFailureError` when more than ``limit`` of step ``step``'s samples are
    unscorable, after writing them all to ``run_dir/unscored_step_<step>.jsonl``."""
    failed = [res for res in rewards if res.unscorable]
    if not rewards or len(failed) / len(rewards) <= limit:
        return
    path = write_samples(run_dir / f"unscored_step_{step}.jsonl", prompts, rollouts, rewards)
    reasons = Counter(res.error for res in failed).most_common(3)
    listed = "; ".join(f"{n}x {err}" for err, n in reasons)
    what = "episodes" if any(r.episode is not None for r in rollouts) else "samples"
    raise RewardFailureError(
        f"step {step}: {len(failed)}/{len(rewards)} {what} could not be scored "
        f"({len(failed) / len(rewards):.0%} > reward.max_failure_rate={limit}); most common: {listed}. "
        f"The step's {what} are saved in {path}" + _first_traceback(rollouts, run_dir / "episode_errors.log")
    )


def _first_traceback(rollouts: list[Rollout], log: Path) -> str:
    """The innermost frame and the exception of the first failed episode that has a traceback,
    with where the whole tracebacks are (an environment's or agent function's own error)."""
    for r in rollouts:
        text = r.episode.info.get("env_traceback") if r.episode is not None else None
        if text:
            lines = [line for line in text.rstrip().splitlines() if line.strip(" ^~")]  # no 3.11 caret lines
            return f"\nthe first failure (every traceback is in {log}):\n" + "\n".join(lines[-3:])
    return ""
