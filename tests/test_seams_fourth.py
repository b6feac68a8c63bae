"""Issue 59 (the seams, fourth pass), what a user sees of it: a field an agent run of some kind never
reads is refused by name; a saved config loads again; a run of several policies shows each policy's
start-up lines and its watches see its own metrics."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter

from postrl.config.agent import UNREAD, AgentConfig, EnvAgent, FunctionAgent, SeatedAgent
from postrl.config.loading import build_config
from postrl.config.run import RunConfig
from postrl.types import StepMetrics

FUNCTION = {"function": "tests.policy_agents:propose_and_solve"}
SEATED = {"env": "tests.seated_envs:Relay", "seats": {"writer": "alice", "reader": "bob"}}
VERIFIERS = {"verifiers": "tests.verifiers_envs:load_game"}
KINDS = {"function": FUNCTION, "seated": SEATED, "env": {"env": "calculator"}, "verifiers": VERIFIERS}
SET = {  # a value for each field a kind may not read
    "env": "calculator",
    "function": FUNCTION["function"],
    "seats": {"writer": "alice"},
    "env_options": {"digits": 2},
    "max_turns": 4,  # its default elsewhere: refused all the same, it is not read
    "max_tokens_per_turn": 64,
    "on_turn_length": "continue",
    "scheduling": "lockstep",
    "max_concurrent_episodes": 4,
    "env_timeout_s": 5.0,
    "function_timeout_s": 30.0,
    "tools_in_prompt": "system",
    "mcp_servers": [{"name": "calc", "command": ["calc-server"]}],
}


def agent(**fields):
    return TypeAdapter(AgentConfig).validate_python(fields)


@pytest.mark.parametrize(("kind", "field"), [(k, f) for k, fields in UNREAD.items() for f in fields])
def test_a_field_its_kind_never_reads_is_refused_by_name(kind, field):
    with pytest.raises(ValueError, match=rf"agent\.{field} is not read by .*{kind if kind != 'env' else 'agent.env'}"):
        agent(**KINDS[kind], **{field: SET[field]})
    assert agent(**KINDS[kind]).kind == kind


def test_each_kind_is_its_own_model_with_only_the_fields_it_reads():
    """The union's members: a function run has no episode limits, an environment run no time limit
    of a function, a seated run no tools; what each reads is taken."""
    function = agent(**FUNCTION, function_timeout_s=30, env_workers=2, max_context=256)
    assert isinstance(function, FunctionAgent) and function.function_timeout_s == 30
    assert "max_turns" not in FunctionAgent.model_fields and "seats" not in EnvAgent.model_fields
    seated = agent(**SEATED, max_turns=6, scheduling="lockstep", env_timeout_s=5, max_concurrent_episodes=2)
    assert isinstance(seated, SeatedAgent) and (seated.max_turns, seated.scheduling, seated.env_timeout_s) == (
        6,
        "lockstep",
        5,
    )
    assert seated.on_turn_length == "continue"  # a cut move goes to the game, as a game would judge it
    env = agent(env="calculator", scheduling="lockstep", env_timeout_s=5, on_turn_length="continue")
    assert isinstance(env, EnvAgent) and (env.kind, env.scheduling) == ("env", "lockstep")
    with pytest.raises(ValueError, match="agent needs exactly one of env"):
        agent(max_turns=3)


def test_a_config_file_s_unread_agent_field_names_the_field_and_why(tmp_path):
    with pytest.raises(Exception, match=r"agent\.max_turns is not read by an agent\.function run: your function"):
        build_config({"model": {"path": "demo"}, "agent": {**FUNCTION, "max_turns": 3}})
    with pytest.raises(Exception, match=r"unknown config field 'agent\.max_turnz' \(allowed: .*max_turns"):
        build_config({"model": {"path": "demo"}, "agent": {"env": "calculator", "max_turnz": 3}})


def test_a_saved_config_of_each_kind_loads_again_and_a_seated_run_s_policies_validate():
    """config.yaml holds every field (defaults included); each policy's run drops what only the
    shared episodes read (the seats, the games' time limit)."""
    for shared in (FUNCTION, {**SEATED, "env_timeout_s": 30.0}):
        policies = {"alice": {}, "bob": {}} if "seats" in shared else None
        config = RunConfig.model_validate({"model": {"path": "demo"}, "agent": shared, "policies": policies})
        again = RunConfig.model_validate(config.model_dump(mode="json"))
        assert again.agent == config.agent and type(again.agent) is type(config.agent)
        for run in config.policy_runs().values():
            assert run.agent is not None and run.agent.kind == ("env" if "seats" in shared else "function")


def test_each_policy_s_watches_see_its_own_metrics_under_their_own_names():
    from postrl.run.policies_runner import observe_policy

    seen: list[StepMetrics] = []

    class Watch:
        def observe(self, metrics: StepMetrics) -> None:
            seen.append(metrics)

    step = StepMetrics(3, 2, {"a/rollout/logprob_diff_max": 0.7, "b/rollout/logprob_diff_max": 0.1}, {"a/x": "y"})
    observe_policy(Watch(), "a", step)
    assert seen == [StepMetrics(3, 2, {"rollout/logprob_diff_max": 0.7}, {"x": "y"})]
