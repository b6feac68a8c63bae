"""Seated environments (``agent.env`` with ``agent.seats``): the environment says which seat acts at
each turn, each seat is played by its own policy, and each policy's samples are its seat's turns
only, token-exact, rewarded with its seat's rewards."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from postrl.config.run import RunConfig
from postrl.models.loading import load_causal_lm, load_tokenizer
from postrl.rollout.agentic.env_lookup import seated_environment_factory
from postrl.rollout.agentic.episode_ops import EpisodeLimits
from postrl.rollout.agentic.lockstep import Lockstep
from postrl.rollout.agentic.seated_games import SeatedGames, SeatPlayer
from postrl.rollout.native import NativeRolloutWorker
from postrl.types import Prompt, SamplingParams
from tests import seated_envs

SEATING = {"writer": "alice", "reader": "bob"}
LIMITS = EpisodeLimits(max_turns=4, max_tokens_per_turn=6, end_on_turn_length=False, env_workers=2)


@pytest.fixture
def two_policies(tiny_model_dir):
    """alice: the demo model; bob: a tiny random one; one tokenizer."""
    tokenizer = load_tokenizer("demo")
    engines = {
        "alice": NativeRolloutWorker.from_hf(load_causal_lm("demo"), tokenizer, torch.float32),
        "bob": NativeRolloutWorker.from_hf(load_causal_lm(str(tiny_model_dir)), tokenizer, torch.float32),
    }
    return engines, tokenizer


def games(engines, tokenizer, env=seated_envs.Relay, seating=SEATING, **options) -> SeatedGames:
    players = {name: SeatPlayer(e, tokenizer, SamplingParams()) for name, e in engines.items()}
    return SeatedGames(env, options, env.__name__, seating, players, LIMITS, Lockstep())


def play(engines, tokenizer, played: SeatedGames, prompts: list[str], n: int = 2):
    return played.run_policies([Prompt(t, []) for t in prompts], SamplingParams(n=n, max_tokens=6))


def relay(engines, tokenizer, **options) -> SeatedGames:
    return games(engines, tokenizer, **options)


def test_each_policy_trains_on_its_own_seat_s_turns(two_policies):
    """The writer's policy gets one sample per episode holding its two turns (the reader's answer
    between them as context, not trained), the reader's policy one with its one turn; every token
    is its own engine's; each policy's reward is its seat's sum."""
    engines, tokenizer = two_policies
    seated_envs.ACTIONS.clear()
    out = play(engines, tokenizer, relay(engines, tokenizer), ["12+34=", "5+6="])
    assert len(out["alice"]) == len(out["bob"]) == 4
    actions = list(seated_envs.ACTIONS)
    assert len(actions) == 12  # 4 episodes of 3 turns
    for r in out["alice"]:  # the episode's messages are the seat's whole conversation
        messages = r.episode.messages
        assert r.episode.seat == "writer" and [m["role"] for m in messages] == ["user", "assistant"] * 2
        first, shown, second = (m["content"] for m in messages[1:])
        generated = tokenizer.decode([t for t, m in zip(r.response_ids, r.loss_mask, strict=True) if m])
        assert generated.startswith(first) and second in generated[len(first) :]
        assert shown in tokenizer.decode(r.response_ids) and r.loss_mask.count(0) > 0  # the reader's: not trained
        assert ("writer", messages[0]["content"], first) in actions and shown.startswith("reader says")
        assert ("writer", shown, second) in actions
        assert r.episode.reward == pytest.approx(sum(c.isdigit() for c in first + second) / 6)  # per-turn sums round
    for r in out["bob"]:
        shown, answer = (m["content"] for m in r.episode.messages)
        assert r.episode.seat == "reader" and answer in tokenizer.decode(r.response_ids)
        assert shown.startswith("writer says") and ("reader", shown, answer) in actions
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
    out = play(engines, tokenizer, relay(engines, tokenizer, bad=bad), ["1+2="], n=1)
    for name in ("alice", "bob"):
        (r,) = out[name]
        assert r.finish_reason == "env_error"
        assert message in r.episode.info["env_error"]


def test_a_seated_game_honours_env_timeout_s_and_max_context(two_policies):
    """A step past agent.env_timeout_s ends its game as unscorable, naming the time-out (the writer,
    who acted, gets its sample with the failure; bob's reader turn was generated, so he has his);
    a seat whose context fills ends its game at max_context."""
    from postrl.rollout.agentic.individual import Individual

    engines, tokenizer = two_policies
    players = {name: SeatPlayer(e, tokenizer, SamplingParams()) for name, e in engines.items()}
    limits = replace(LIMITS, env_timeout_s=0.3)
    slow = SeatedGames(seated_envs.SlowReader, {}, "slow", SEATING, players, limits, Individual())
    out = play(engines, tokenizer, slow, ["1+2="], n=2)
    for r in out["alice"] + out["bob"]:
        assert r.finish_reason == "env_error" and "timed out after 0.3 s" in r.episode.info["env_error"]
    assert len(out["alice"]) == len(out["bob"]) == 2
    full = SeatedGames(seated_envs.Relay, {}, "relay", SEATING, players, replace(LIMITS, max_context=24), Lockstep())
    out = play(engines, tokenizer, full, ["1+2="], n=2)
    contexts = [len(r.prompt_ids) + len(r.response_ids) for r in out["alice"] + out["bob"]]
    assert all(r.finish_reason == "max_context" for r in out["alice"]) and max(contexts) <= 24


def test_an_environment_without_seats_or_with_other_seats_is_refused(two_policies):
    engines, tokenizer = two_policies
    not_seated = games(engines, tokenizer, seated_envs.NotSeated)
    (r,) = play(engines, tokenizer, not_seated, ["1+2="], n=1)["alice"]
    assert "NotSeated is not a seated environment" in r.episode.info["env_error"]
    other = games(engines, tokenizer, seating={"writer": "alice", "judge": "bob"})
    (r,) = play(engines, tokenizer, other, ["1+2="], n=1)["bob"]
    assert (
        "agent.seats names seat 'judge' that the environment does not have (a typo?) and leaves seat 'reader' of "
        "the environment without a policy: the environment Relay has seats ['writer', 'reader']"
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
    assert all(run.agent.kind == "env" for run in good.policy_runs().values())  # the seats: the run's, not a policy's


def seats_run(tmp_path, data, env: str, name: str, bob: str = "{}") -> list[str]:
    """``postrl train`` arguments: two steps of tests.seated_envs' ``env``, writer alice, reader bob."""
    config = tmp_path / f"{name}.yaml"
    config.write_text(
        f"agent: {{env: 'tests.seated_envs:{env}', seats: {{writer: alice, reader: bob}}, max_tokens_per_turn: 6, "
        f"max_context: 128, env_workers: 4}}\npolicies:\n  alice: {{}}\n  bob: {bob}\n"
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
    validation = seated_envs.ACTIONS[-9:]  # the last 3 games, 3 turns each, greedy, interleaved
    turns = {seat: [(shown, action) for s, shown, action in validation if s == seat] for seat in SEATING}
    assert len(turns["writer"]) == 6 and len(turns["reader"]) == 3
    assert {shown for shown, _ in turns["writer"] if "says" not in shown} == {"0*3=", "1*3=", "2*3="}
    writes = {action for shown, action in turns["writer"] if "says" not in shown}
    assert {shown for shown, _ in turns["reader"]} == {f"writer says: {a}" for a in writes}
    digits = lambda text: sum(c.isdigit() for c in text) / 6  # noqa: E731
    for seat, policy in SEATING.items():  # each game's reward is its seat's turns' (summed over the 3 games)
        total = sum(digits(action) for _, action in turns[seat])
        assert rows[1][f"{policy}/val/reward_mean"] == pytest.approx(total / 3)
    for name, seat_turns in (("alice", 2), ("bob", 1)):
        assert all(r[f"{name}/reward/samples"] == 4 for r in rows)
        assert any(r[f"{name}/actor/grad_norm"] > 0 for r in rows)  # each policy learns from its own samples
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
    assert all(
        r["alice/reward/samples"] == 4 and not math.isnan(r["alice/actor/grad_norm"]) for r in rows
    )  # it updates
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


def _learning(row: dict) -> dict:
    """A metrics row without what the clock or the machine decides (times, rates, memory); NaN as
    text, so that two rows compare equal."""
    clocked = ("time/", "perf/", "memory/", "_s", "tokens_per_s", "elapsed")
    return {k: "nan" if v != v else v for k, v in row.items() if not any(part in k for part in clocked)}


SAMPLED = ("/reward/", "/response/", "/agent/", "/accuracy")  # what the sampled tokens alone decide


def assert_same_run(rows: list[dict], expected: list[dict]) -> None:
    """The same games (every reward, length, turn: exactly) and the same learning, up to the last
    bits a batch's make-up changes in the engine's float32 logprobs (lockstep batches every game's
    turn together, individual scheduling as the turns come)."""
    assert [sorted(r) for r in rows] == [sorted(r) for r in expected]
    for row, want in zip(rows, expected, strict=True):
        assert {k: v for k, v in row.items() if any(s in k for s in SAMPLED)} == {
            k: v for k, v in want.items() if any(s in k for s in SAMPLED)
        }
        numbers = {k: v for k, v in want.items() if isinstance(v, float)}
        assert {k: row[k] for k in numbers} == pytest.approx(numbers, rel=1e-4, abs=1e-6)


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory, char_tokenizer):
    """A tiny random Llama that takes a TicTacToe board's 1024 characters."""
    from tests.conftest import make_tiny_model

    out = tmp_path_factory.mktemp("tiny_llama_1k")
    make_tiny_model("llama", char_tokenizer, max_positions=1024).save_pretrained(out, safe_serialization=True)
    char_tokenizer.save_pretrained(out)
    return out


def seated_metrics(tmp_path, model, env: str, seats: str, scheduling: str, name: str) -> list[dict]:
    """The learning metrics of two steps of ``env`` played by alice and bob, four games at once."""
    from postrl.cli import main

    seeds = tmp_path / "seeds.jsonl"
    seeds.write_text("".join(json.dumps({"prompt": f"{s}+{s}=", "seed": s}) + "\n" for s in range(4)))
    config = tmp_path / f"{name}.yaml"
    config.write_text(
        f"agent: {{env: '{env}', seats: {seats}, max_turns: 4, max_tokens_per_turn: 8, max_context: 1024, "
        f"env_workers: 4, scheduling: {scheduling}}}\npolicies:\n  alice: {{}}\n  bob: {{train: {{lr: 0.001}}}}\n"
    )
    args = [
        "train", str(config), f"output_dir={tmp_path}/runs", f"name={name}", f"model.path={model}", "steps=2",
        f"data.train_files=[{seeds}]", "data.task=null", "prompts_per_step=2", "rollout.n=2", "seed=3",
        "logging.trackers=[jsonl]", "train.mini_batch_size=4", "train.micro_batch_size=4",
    ]  # fmt: skip
    assert main(args) == 0
    metrics = tmp_path / "runs" / name / "metrics.jsonl"
    return [_learning(json.loads(line)) for line in metrics.read_text().splitlines()]


def test_a_seated_textarena_run_repeats_its_metrics_for_a_seed_at_four_env_workers(tmp_path, long_context_model):
    """TicTacToe, two policies, four games played at once, each turn on its policy's engine: the
    same seed gives the same metrics twice, whatever order the games' turns interleave in."""
    pytest.importorskip("textarena")
    seats = "{player_0: alice, player_1: bob}"
    first, second = (
        seated_metrics(tmp_path, long_context_model, "textarena:TicTacToe-v0", seats, "individual", run)
        for run in ("first", "second")
    )
    assert_same_run(second, first)
    assert [r["alice/reward/samples"] for r in first] == [4, 4] and first[0]["alice/agent/turns_mean"] >= 1
    assert first[0]["alice/response/length_mean"] > 300  # the board, then its moves: a seat's whole game


def test_seated_games_repeat_for_a_seed_and_either_schedule_plays_the_same_games(tmp_path, long_context_model):
    """Both seats act in every game (writer, reader, writer), four games at once: individual
    scheduling repeats its metrics for a seed, and lockstep plays the same games (each turn samples
    from its game's own stream)."""
    seats = "{writer: alice, reader: bob}"
    runs = {
        (scheduling, run): seated_metrics(
            tmp_path, long_context_model, "tests.seated_envs:Relay", seats, scheduling, f"{scheduling}-{run}"
        )
        for scheduling, run in (("individual", 1), ("individual", 2), ("lockstep", 1))
    }
    first = runs["individual", 1]
    assert_same_run(runs["individual", 2], first)
    assert_same_run(runs["lockstep", 1], first)
    assert all(r["alice/agent/turns_mean"] == 2 and r["bob/agent/turns_mean"] == 1 for r in first)
    assert all(r["bob/reward/samples"] == 4 for r in first)
    assert any(r["alice/actor/grad_norm"] > 0 for r in first) and any(r["bob/actor/grad_norm"] > 0 for r in first)


def test_a_seat_s_turn_samples_as_its_policy_does_and_held_out_games_are_greedy():
    """Each policy's own temperature, top_p, top_k and stops (not the policy's that ran the batch);
    the game's token budget; greedy stays greedy."""
    own = SamplingParams(n=4, temperature=0.7, top_p=0.9, top_k=5, max_tokens=99, stop=("X",), stop_token_ids=(5,))
    player = SeatPlayer(None, None, own)
    batch = SamplingParams(n=1, temperature=1.0, max_tokens=12, stop=("other's",), stop_token_ids=(9,))
    turn = player.turn(batch, [3, 7])
    assert turn == SamplingParams(1, 0.7, 0.9, 5, 12, ("X", "</tool_call>"), (3, 5, 7))
    assert player.turn(replace(batch, temperature=0.0), [3]) == SamplingParams(1, 0.0, 0.9, 5, 12, turn.stop, (3, 5))
