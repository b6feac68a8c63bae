"""The batch source of a run, built once: single-turn samples, or an ``agent:`` run's episodes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from postrl.config.agent import KIND_RUNS, AgentBase, EnvAgent, FunctionAgent, VerifiersAgent
from postrl.controller.env_episodes import EnvEpisodes
from postrl.controller.function_episodes import AgentFunctionEpisodes
from postrl.controller.source import BatchSource, SingleTurn
from postrl.controller.verifiers_episodes import VerifiersEpisodes
from postrl.rollout.agentic.agent_function import RecordedAgents, load_agent_function
from postrl.rollout.agentic.verifiers_env import VerifiersGroups, load_environment
from postrl.serve.recording_server import RecordingServer
from postrl.workers.roles import RewardService, RolloutWorker


def make_batch_source(
    agent: AgentBase | None,
    tokenizer: Any,
    rollout: RolloutWorker,
    reward: RewardService,
    errors_log: Path | None = None,
    model: str = "the model",
) -> BatchSource:
    """``errors_log``: where a failed episode's traceback goes; ``model``: its name in errors."""
    if agent is None:
        return SingleTurn(rollout, reward, tokenizer)
    if isinstance(agent, EnvAgent):
        return EnvEpisodes(agent, tokenizer, rollout, reward, errors_log, model)
    if isinstance(agent, VerifiersAgent):
        env = load_environment(agent)
        server = RecordingServer.of_engine(rollout, tokenizer, agent.tools_in_prompt, agent.max_context)
        groups = VerifiersGroups(server, env, agent.env_workers, agent.group_timeout_s)
        return VerifiersEpisodes(tokenizer, groups, reward, agent, errors_log, model)
    if not isinstance(agent, FunctionAgent):
        raise TypeError(f"{KIND_RUNS[agent.kind]} is played by several policies (policies:), not by one run's engine")
    function = load_agent_function(agent.function)
    server = RecordingServer.of_engine(rollout, tokenizer, agent.tools_in_prompt)
    agents = RecordedAgents(server, function, agent.env_workers, agent.function_timeout_s)
    return AgentFunctionEpisodes(agent, tokenizer, agents, rollout, reward, errors_log)
