"""TextArena, skyrl-gym and GEM environments driven through postrl's episode loop for real:
token-exact trajectories, per-episode seeds that give the same games on a second run whatever
the threads' interleaving, and a game that needs NLTK data refused by name instead of hanging."""

from __future__ import annotations

import time

import pytest

from postrl.rollout.agentic.chat import ChatRenderer
from postrl.rollout.agentic.env_lookup import environment_factory
from postrl.rollout.agentic.episodes import EpisodeLimits, EpisodeRunner
from postrl.types import Prompt, Rollout, SamplingParams
from tests.chat_templates import family_tokenizer


def play(spec: str, moves: list[str], rows: list[dict], n: int = 2, max_turns: int = 4) -> list[Rollout]:
    """Episodes of ``spec`` whose model turns are ``moves`` (one per turn, the same for every
    episode), through the runner with a scripted engine."""
    tok = family_tokenizer("qwen2.5")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    calls = []

    def generate(prompts: list[Prompt], sp: SamplingParams) -> list[Rollout]:
        ids = tok.encode(moves[min(len(calls), len(moves) - 1)], add_special_tokens=False) + [end]
        calls.append(len(prompts))
        return [Rollout(i, list(p.prompt_ids), ids, [-0.5] * len(ids), tok.decode(ids), "stop", 0)
                for i, p in enumerate(prompts)]  # fmt: skip

    runner = EpisodeRunner(generate, environment_factory(spec), tok, EpisodeLimits(max_turns=max_turns), "split")
    try:
        prompts = [Prompt(r.get("prompt", "play"), [], columns=r, messages=None) for r in rows]
        return runner.run(prompts, SamplingParams(n=n, max_tokens=64))
    finally:
        runner.close()


def assert_token_exact(rollout: Rollout) -> None:
    """The trajectory is the rendering of the episode's conversation, model turns under the loss mask."""
    tok = family_tokenizer("qwen2.5")
    renderer = ChatRenderer(tok)
    episode = rollout.episode
    assert rollout.prompt_ids == renderer.encode(renderer.render(episode.messages[:1], generation_prompt=True))
    last = max(i for i, m in enumerate(episode.messages) if m["role"] == "assistant")
    trained = episode.messages[: last + 1]  # what came after the last model turn is not trained on
    assert tok.decode(rollout.prompt_ids + rollout.response_ids) + "\n" == renderer.render(
        trained, generation_prompt=False
    )
    model_tokens = sum(t.generated_tokens for t in episode.turns)
    assert sum(rollout.loss_mask) == model_tokens


def transcript(rollouts: list[Rollout]) -> list[tuple]:
    return [(r.prompt_index, [m["content"] for m in r.episode.messages], r.episode.reward) for r in rollouts]


def test_a_textarena_game_is_played_token_exact_with_seeded_reproducible_games():
    pytest.importorskip("textarena")
    rows = [{"prompt": "play", "seed": s} for s in (1, 2, 3)]
    moves = ["[1 2 3 4]", "[2 3 4 5]", "[3 4 5 6]"]
    first = play("textarena:Mastermind-v0", moves, rows, n=3)
    second = play("textarena:Mastermind-v0", moves, rows, n=3)
    assert transcript(first) == transcript(second)  # the same secret codes, episode by episode
    by_seed = {r.prompt_index: r.episode.messages[2]["content"] for r in first}
    assert len(set(by_seed.values())) > 1  # other seeds, other codes: the feedback differs
    assert all(len({r.episode.messages[2]["content"] for r in first if r.prompt_index == i}) == 1 for i in range(3))
    for r in first:
        assert_token_exact(r)
        assert r.episode.messages[0]["content"].startswith("You are playing Mastermind.")
        assert (
            "Feedback:" in r.episode.messages[2]["content"]
            and "[1 2 3 4]\nSubmitted" not in r.episode.messages[2]["content"]
        )
        assert r.episode.finish_reason == "max_turns" and len(r.episode.turns) == 4


def test_a_textarena_game_that_ends_gives_its_reward():
    pytest.importorskip("textarena")
    (r,) = play("textarena:Mastermind-v0", ["[1 2 3 4]", "[1 2 3 4]"], [{"seed": 5}], n=1)
    # a repeated guess is an invalid move: the first is answered with a warning, the second ends the game
    assert r.episode.finish_reason == "stop" and len(r.episode.turns) == 3
    assert "invalid move" in r.episode.messages[4]["content"]
    assert r.episode.reward == pytest.approx(0.375)  # TextArena's partial credit for seed 5's code and [1 2 3 4]


def test_a_gem_game_is_played_token_exact_with_seeded_reproducible_games():
    pytest.importorskip("gem")
    rows = [{"prompt": "play", "seed": s} for s in (10, 11)]
    moves = ["\\boxed{1 2}", "\\boxed{3 4}", "\\boxed{5 6}"]
    first = play("gem:game:Mastermind-v0-easy", moves, rows, n=2, max_turns=3)
    assert transcript(first) == transcript(play("gem:game:Mastermind-v0-easy", moves, rows, n=2, max_turns=3))
    for r in first:
        assert_token_exact(r)
        assert "Mastermind" in r.episode.messages[0]["content"]


def test_a_skyrl_gym_environment_takes_its_ground_truth_from_the_row():
    pytest.importorskip("skyrl_gym")
    rows = [{"prompt": "What is 2+3?", "answer": "5"}, {"prompt": "What is 4+4?", "answer": "9"}]
    rollouts = play("skyrl_gym:gsm8k_multi_turn", ["The sum. #### 5"], rows, n=1, max_turns=5)
    right, wrong = sorted(rollouts, key=lambda r: r.prompt_index)
    assert right.episode.reward == 1.0 and len(right.episode.turns) == 1  # correct: done at once
    assert len(wrong.episode.turns) == 5 and wrong.episode.reward < 1.0  # asked again each turn, never right
    for r in rollouts:
        assert_token_exact(r)


def test_a_game_that_would_download_nltk_data_fails_at_once_naming_it():
    pytest.importorskip("textarena")
    began = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"Wordle-v0 needs NLTK data that is not installed \(.*words"):
        environment_factory("textarena:Wordle-v0")()
    assert time.perf_counter() - began < 10


def test_unknown_library_environments_are_named():
    pytest.importorskip("textarena")
    with pytest.raises(ValueError, match="TextArena has no game 'Mastermind-v9'.*Mastermind-v0"):
        environment_factory("textarena:Mastermind-v9")()
    with pytest.raises(ValueError, match="skyrl-gym has no environment 'nope'"):
        environment_factory("skyrl_gym:nope")()


@pytest.mark.slow
def test_postrl_train_plays_a_textarena_game(tmp_path):
    """Two GRPO steps of a tiny model on TextArena's Mastermind through ``postrl train``: the
    game's reward is the episode's, the rows' seeds choose the codes."""
    pytest.importorskip("textarena")
    import json

    from transformers import LlamaForCausalLM

    from postrl.config.loading import build_config
    from postrl.run.train_runner import train
    from tests.conftest import make_tiny_model

    tok = family_tokenizer("qwen2.5")
    config = make_tiny_model("llama", tok).config
    config.max_position_embeddings = 1024
    model_dir = tmp_path / "model"
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = tmp_path / "games.jsonl"
    data.write_text("".join(json.dumps({"prompt": "Mastermind", "seed": s}) + "\n" for s in range(8)))
    run = build_config({
        "name": "mastermind", "output_dir": str(tmp_path), "steps": 2, "prompts_per_step": 2,
        "model": {"path": str(model_dir)}, "data": {"train_files": [str(data)]},
        "agent": {"env": "textarena:Mastermind-v0", "max_turns": 2, "max_tokens_per_turn": 6, "max_context": 1024,
                  "on_turn_length": "continue"},
        "rollout": {"n": 2, "max_tokens": 6}, "train": {"mini_batch_size": 4, "micro_batch_size": 4},
        "logging": {"trackers": ["jsonl"], "samples_first_steps": 2},
    })  # fmt: skip
    assert train(run).completed_steps == 2
    samples = [json.loads(line) for line in (run.run_dir / "samples" / "step_1.jsonl").read_text().splitlines()]
    # a random model's guesses are invalid: the game warns after the first and ends itself after the second
    assert [(s["episode"]["finish_reason"], s["episode"]["turns"]) for s in samples] == [("stop", 2)] * 4
    assert all(s["components"] == {"environment": 0.0} and s["error"] is None for s in samples)
    assert not (run.run_dir / "episode_errors.log").exists()
