"""Seated environments (``agent.env`` with ``agent.seats``): the environment says which seat acts at
each turn, each seat is played by its own policy, and each policy's samples are its seat's turns
only, token-exact, rewarded with its seat's rewards."""

from __future__ import annotations

import json
import math

import pytest
import torch

from postrl.config.run import RunConfig
from postrl.models.loading import load_causal_lm, load_tokenizer
from postrl.rollout.agentic.agent_function import RecordedAgents
from postrl.rollout.agentic.env_lookup import seated_environment_factory
from postrl.rollout.agentic.seats import SeatedEpisodes, SeatTurns
from postrl.rollout.native import NativeRolloutWorker
from postrl.serve.recording_server import RecordingServer, ServedPolicy
from postrl.types import Prompt, SamplingParams
from tests import seated_envs

SEATING = {"writer": "alice", "reader": "bob"}
TURNS = SeatTurns(max_turns=4, max_tokens=6, temperatures={"alice": 1.0, "bob": 1.0})


@pytest.fixture
def two_policies(tiny_model_dir):
    """alice: the demo model; bob: a tiny random one; one tokenizer."""
    tokenizer = load_tokenizer("demo")
    engines = {
        "alice": NativeRolloutWorker.from_hf(load_causal_lm("demo"), tokenizer, torch.float32),
        "bob": NativeRolloutWorker.from_hf(load_causal_lm(str(tiny_model_dir)), tokenizer, torch.float32),
    }
    return engines, tokenizer


def play(engines, tokenizer, episodes: SeatedEpisodes, prompts: list[str], n: int = 2):
    server = RecordingServer({name: ServedPolicy(e, tokenizer) for name, e in engines.items()})
    agents = RecordedAgents(server, episodes, workers=2)
    try:
        return agents.run_policies([Prompt(t, []) for t in prompts], SamplingParams(n=n, max_tokens=6))
    finally:
        agents.close()


def relay(**options) -> SeatedEpisodes:
    return SeatedEpisodes(seated_envs.Relay, options, SEATING, TURNS, "tests.seated_envs:Relay")


def test_each_policy_trains_on_its_own_seat_s_turns(two_policies):
    """The writer's policy gets one sample per episode holding its two turns (the reader's answer
    between them as context, not trained), the reader's policy one with its one turn; every token
    is its own engine's; each policy's reward is its seat's sum."""
    engines, tokenizer = two_policies
    seated_envs.ACTIONS.clear()
    out = play(engines, tokenizer, relay(), ["12+34=", "5+6="])
    assert len(out["alice"]) == len(out["bob"]) == 4
    actions = list(seated_envs.ACTIONS)
    assert len(actions) == 12  # 4 episodes of 3 turns
    for r in out["alice"]:  # the episode's messages are its last call's: the writer's third turn follows
        messages = r.episode.messages
        assert [m["role"] for m in messages] == ["user", "assistant", "user"]
        first, shown = messages[1]["content"], messages[2]["content"]
        generated = [t for t, m in zip(r.response_ids, r.loss_mask, strict=True) if m]
        both = tokenizer.decode(generated, skip_special_tokens=True)
        assert both.startswith(first) and r.loss_mask.count(0) > 0  # the reader's answer: context, not trained
        second = both[len(first) :]
        assert ("writer", messages[0]["content"], first) in actions and shown.startswith("reader says")
        assert ("writer", shown, second) in actions
        assert r.episode.reward == pytest.approx(sum(c.isdigit() for c in first + second) / 6)  # per-turn sums round
    for r in out["bob"]:
        (shown,) = r.episode.messages
        answer = tokenizer.decode(r.response_ids, skip_special_tokens=True)
        assert shown["content"].startswith("writer says") and ("reader", shown["content"], answer) in actions
        assert r.episode.reward == sum(c.isdigit() for c in answer) / 6
    for name, rollouts in out.items():  # rescored by its own engine, each sample gives its logprobs
        for r in rollouts:
            rescored = engines[name].prompt_logprobs([r.prompt_ids + r.response_ids])[0][len(r.prompt_ids) - 1 :]
            own = [lp for lp, m in zip(rescored, r.loss_mask, strict=True) if m]
            got = [lp for lp, m in zip(r.logprobs, r.loss_mask, strict=True) if m]
            assert torch.allclose(torch.tensor(own), torch.tensor(got), atol=1e-3)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("seat", "step('reader') SeatStep.messages names seat 'judge', not one of the environment's"),
        ("reward", "step('reader') SeatStep.rewards['reader'] must be a finite number"),
    ],
)
def test_a_malformed_seat_step_fails_its_episode_naming_the_field(two_policies, bad, message):
    engines, tokenizer = two_policies
    out = play(engines, tokenizer, relay(bad=bad), ["1+2="], n=1)
    for name in ("alice", "bob"):
        (r,) = out[name]
        assert r.finish_reason == "env_error"
        assert message in r.episode.info["env_error"]


def test_an_environment_without_seats_or_with_other_seats_is_refused(two_policies):
    engines, tokenizer = two_policies
    not_seated = SeatedEpisodes(seated_envs.NotSeated, {}, SEATING, TURNS, "tests.seated_envs:NotSeated")
    (r,) = play(engines, tokenizer, not_seated, ["1+2="], n=1)["alice"]
    assert "NotSeated is not a seated environment" in r.episode.info["env_error"]
    other = SeatedEpisodes(seated_envs.Relay, {}, {"writer": "alice", "judge": "bob"}, TURNS, "relay")
    (r,) = play(engines, tokenizer, other, ["1+2="], n=1)["bob"]
    assert (
        "agent.seats names seat 'judge' that the environment does not have (a typo?) and leaves seat 'reader' of "
        "the environment without a policy: the environment relay has seats ['writer', 'reader']"
    ) in r.episode.info["env_error"]


def test_textarena_players_are_seats_each_shown_the_other_s_moves():
    """TicTacToe: player_0 opens; player_1 is shown player_0's move (not its own, the next turn);
    the game's end rewards each seat."""
    pytest.importorskip("textarena")
    env = seated_environment_factory("textarena:TicTacToe-v0")()
    first = env.reset({"prompt": "", "seed": 3})
    assert env.seats == ("player_0", "player_1") and first.next_seat == "player_0"
    assert "You are Player 0" in first.messages["player_0"][0]["content"]
    second = env.step("player_0", "[4]")
    assert second.next_seat == "player_1"
    shown = second.messages["player_1"][0]["content"]
    assert "You are Player 1" in shown and "[4]" in shown and "Player 0 placed their symbol (O) in cell 4" in shown
    third = env.step("player_1", "[0]")
    lines = third.messages["player_0"][0]["content"].splitlines()
    assert "[0]" in lines and "[4]" not in lines  # the other's move, not the echo of its own
    assert "Player 1 placed their symbol (X) in cell 0." in lines
    result = third
    for seat, move in (("player_0", "[3]"), ("player_1", "[1]"), ("player_0", "[5]")):  # O takes the middle row
        assert result.next_seat == seat
        result = env.step(seat, move)
    assert result.done and result.rewards == {"player_0": 1.0, "player_1": -1.0}
    env.close()
    with pytest.raises(ValueError, match="serve-env URL serves one-seat environments"):
        seated_environment_factory("http://127.0.0.1:1")


BASE = {"model": {"path": "demo"}, "agent": {"env": "tests.seated_envs:Relay", "seats": SEATING}}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"policies": None}, "agent.seats: seats are played by the run's policies"),
        ({"policies": {"alice": {}, "carol": {}}}, "agent.seats.reader: 'bob' is not a policy of this run"),
        ({"policies": {"alice": {}, "bob": {}, "carol": {}}}, "policy 'carol' plays no seat"),
        (
            {"agent": {"env": "tests.seated_envs:Relay", "seats": {"writer": "alice", "reader": "alice"}}},
            r"policy 'alice' plays seats \['writer', 'reader'\]",
        ),
        (
            {"agent": {"function": "tests.policy_agents:propose_and_solve", "seats": SEATING}},
            "the seats are a seated environment's",
        ),
        ({"agent": {**BASE["agent"], "reward": "service"}}, "each policy's reward is its seat's"),
    ],
)
def test_seat_config_errors_name_the_field(change, message):
    config = {**BASE, "policies": {"alice": {}, "bob": {}}, **change}
    if config["policies"] is None:
        del config["policies"]
    with pytest.raises(ValueError, match=message):
        RunConfig.model_validate(config)
    good = RunConfig.model_validate({**BASE, "policies": {"alice": {}, "bob": {}}})
    assert all(run.agent.seats is None for run in good.policy_runs().values())  # the run's, not each policy's


def seats_run(tmp_path, data, env: str, name: str, bob: str = "{}") -> list[str]:
    """``postrl train`` arguments: two steps of tests.seated_envs' ``env``, writer alice, reader bob."""
    config = tmp_path / f"{name}.yaml"
    config.write_text(
        f"agent: {{env: 'tests.seated_envs:{env}', seats: {{writer: alice, reader: bob}}, max_tokens_per_turn: 6, "
        f"max_context: 128, env_workers: 1}}\npolicies:\n  alice: {{}}\n  bob: {bob}\n"
    )
    return [
        "train", str(config), f"output_dir={tmp_path}/runs", f"name={name}", "model.path=demo", "steps=2",
        f"data.train_files=[{data}]", "data.task=null", "prompts_per_step=2", "rollout.n=2",
        "logging.trackers=[jsonl]", "train.mini_batch_size=4", "train.micro_batch_size=4",
    ]  # fmt: skip


def test_postrl_train_steps_each_seat_s_policy(tmp_path, arithmetic_jsonl):
    """Both policies train on their own seats' samples; validation (logging.eval_every) plays the
    held-out games once after both steps, each policy reporting its seat's rewards, and takes no
    training batch."""
    from postrl.cli import main

    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"prompt": f"{a}*3=", "answer": str(3 * a)}) + "\n" for a in range(3)))

    args = seats_run(tmp_path, arithmetic_jsonl, "Relay", "seats", "{train: {lr: 0.001}}")
    args += ["logging.eval_every=2", f"data.val_files=[{held_out}]"]
    seated_envs.ACTIONS.clear()
    assert main(args) == 0
    run = tmp_path / "runs" / "seats"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert "alice/val/reward_mean" not in rows[0] and rows[1]["alice/val/prompts"] == rows[1]["bob/val/prompts"] == 3
    validation = [a for a in seated_envs.ACTIONS[-9:]]  # the last 3 games: 3 turns each, greedy
    assert [seat for seat, _, _ in validation] == ["writer", "reader", "writer"] * 3
    assert {shown for seat, shown, _ in validation[::3]} == {"0*3=", "1*3=", "2*3="}
    digits = lambda text: sum(c.isdigit() for c in text) / 6  # noqa: E731
    writer = [digits(validation[i][2]) + digits(validation[i + 2][2]) for i in (0, 3, 6)]
    reader = [digits(validation[i + 1][2]) for i in (0, 3, 6)]
    assert rows[1]["alice/val/reward_mean"] == pytest.approx(sum(writer) / 3)
    assert rows[1]["bob/val/reward_mean"] == pytest.approx(sum(reader) / 3)
    for name, seat_turns in (("alice", 2), ("bob", 1)):
        assert all(r[f"{name}/reward/samples"] == 4 for r in rows)
        assert rows[0][f"{name}/actor/grad_norm"] > 0  # (bob, at lr 1e-3, writes only digits by step 2)
        samples = [json.loads(line) for line in (run / "policies" / name / "samples" / "step_1.jsonl").open()]
        assert len(samples) == 4
        assert all(s["response"].count("</s>") <= seat_turns for s in samples)
    assert (run / "final_model" / "alice" / "config.json").is_file() and (run / "final_model" / "bob").is_dir()


def test_a_policy_whose_seat_never_acts_in_a_batch_skips_its_update(tmp_path, arithmetic_jsonl, capsys):
    """The reader never gets a turn (the game ends first): its policy has no sample in any batch; it
    skips its update (no samples, no gradient), the writer's policy trains, and the run completes."""
    from postrl.cli import main

    assert main(seats_run(tmp_path, arithmetic_jsonl, "WriterAlone", "alone")) == 0
    assert "|| bob | s 0.0 | no sample: the policy took no turn in this batch's episodes" in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "runs" / "alone" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["alice/reward/samples"] == 4 for r in rows) and rows[0]["alice/actor/grad_norm"] > 0
    assert all(r["bob/reward/samples"] == 0 and math.isnan(r["bob/actor/grad_norm"]) for r in rows)  # skipped


def test_seats_the_environment_lacks_stop_the_run_before_its_first_step(tmp_path, arithmetic_jsonl, capsys):
    from postrl.cli import main

    args = seats_run(tmp_path, arithmetic_jsonl, "Relay", "typo")
    config = tmp_path / "typo.yaml"
    config.write_text(config.read_text().replace("reader: bob", "raeder: bob"))
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "agent.seats names seat 'raeder' that the environment does not have (a typo?)" in err
    assert "has no seat" not in err  # the seats, not the environment, were misnamed
    assert not (tmp_path / "runs" / "typo" / "metrics.jsonl").exists()
