"""Issue 59 (the seams, fourth pass), what a user sees of it: a field an agent run of some kind never
reads is refused by name; a saved config loads again; a run of several policies shows each policy's
start-up lines and its watches see its own metrics."""

from __future__ import annotations

import pytest

from postrl.config.agent import UNREAD, AgentConfig
from postrl.config.run import RunConfig
from postrl.types import StepMetrics

FUNCTION = {"function": "tests.policy_agents:propose_and_solve"}
SEATED = {"env": "tests.seated_envs:Relay", "seats": {"writer": "alice", "reader": "bob"}}
KINDS = {"function": FUNCTION, "seated": SEATED, "env": {"env": "calculator"}}
SET = {  # a value other than each field's default
    "env_options": {"digits": 2},
    "max_turns": 8,
    "max_tokens_per_turn": 64,
    "on_turn_length": "continue",
    "scheduling": "lockstep",
    "max_concurrent_episodes": 4,
    "env_timeout_s": 5.0,
    "function_timeout_s": 30.0,
}


@pytest.mark.parametrize(("kind", "field"), [(k, f) for k, fields in UNREAD.items() for f in fields])
def test_a_field_its_kind_never_reads_is_refused_by_name(kind, field):
    with pytest.raises(ValueError, match=rf"agent\.{field} is not read by .*{kind if kind != 'env' else 'agent.env'}"):
        AgentConfig(**KINDS[kind], **{field: SET[field]})
    assert AgentConfig(**KINDS[kind]).kind == kind  # at its default it is no setting: accepted


def test_what_each_kind_reads_is_taken():
    assert AgentConfig(**FUNCTION, function_timeout_s=30, env_workers=2, max_context=256).function_timeout_s == 30
    seated = AgentConfig(**SEATED, max_turns=6, max_tokens_per_turn=32, function_timeout_s=30, env_options={"n": 1})
    assert (seated.kind, seated.max_turns, seated.function_timeout_s) == ("seated", 6, 30)
    env = AgentConfig(env="calculator", scheduling="lockstep", env_timeout_s=5, on_turn_length="continue")
    assert (env.kind, env.scheduling) == ("env", "lockstep")


def test_a_saved_config_of_each_kind_loads_again_and_a_seated_run_s_policies_validate():
    """config.yaml holds every field (defaults included); each policy's run drops what only the
    shared episodes read (the seats, the games' time limit)."""
    for agent in (FUNCTION, {**SEATED, "function_timeout_s": 30.0}):
        policies = {"alice": {}, "bob": {}} if "seats" in agent else None
        config = RunConfig.model_validate({"model": {"path": "demo"}, "agent": agent, "policies": policies})
        again = RunConfig.model_validate(config.model_dump(mode="json"))
        assert again.agent == config.agent
        for run in config.policy_runs().values():
            assert run.agent is not None and run.agent.kind == "env" and run.agent.seats is None


def test_each_policy_s_watches_see_its_own_metrics_under_their_own_names():
    from postrl.run.policies_runner import observe_policy

    seen: list[StepMetrics] = []

    class Watch:
        def observe(self, metrics: StepMetrics) -> None:
            seen.append(metrics)

    step = StepMetrics(3, 2, {"a/rollout/logprob_diff_max": 0.7, "b/rollout/logprob_diff_max": 0.1}, {"a/x": "y"})
    observe_policy(Watch(), "a", step)
    assert seen == [StepMetrics(3, 2, {"rollout/logprob_diff_max": 0.7}, {"x": "y"})]
