"""reasoning-gym runs end to end: a curriculum run stopped and resumed gives the same levels and
prompts as one straight run; named eval sets in the metrics; ``postrl eval``'s harness against a
real ``serve-rollout`` server on loopback, equal to the same model evaluated in process."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("reasoning_gym")

from postrl.config.loading import build_config  # noqa: E402
from postrl.run.train_runner import train  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def long_tiny_dir(tmp_path_factory, char_tokenizer):
    """The tiny random Llama with room for reasoning-gym questions (a character per token)."""
    from transformers import LlamaForCausalLM

    from tests.conftest import make_tiny_model

    config = make_tiny_model("llama", char_tokenizer).config
    config.max_position_embeddings = 512
    out = tmp_path_factory.mktemp("tiny_llama_512")
    LlamaForCausalLM(config).save_pretrained(out)
    char_tokenizer.save_pretrained(out)
    return out


def gym_config(tmp_path, model_dir, name: str, steps: int) -> dict:
    return {
        "name": name,
        "output_dir": str(tmp_path),
        "steps": steps,
        "prompts_per_step": 4,
        "model": {"path": str(model_dir)},
        "data": {
            "reasoning_gym": {
                "tasks": [{"name": "chain_sum", "weight": 3, "level": 3}, {"name": "gcd", "config": {"max_value": 50}}],
                "size": 40,
                "val_size": 10,
                "chat_template": False,
                "curriculum": {"window": 4, "raise_at": 0.75, "lower_at": 0.0},
            },
            "max_prompt_tokens": 400,
            "eval_sets": [
                {
                    "name": "harder",
                    "reasoning_gym": {"tasks": [{"name": "chain_sum", "level": 5}], "val_size": 6, "seed": 10},
                }
            ],  # fmt: skip
        },
        "rollout": {"n": 2, "max_tokens": 6},
        "train": {"mini_batch_size": 8, "micro_batch_size": 8},
        "logging": {"eval_every": 2, "trackers": ["jsonl"], "samples_first_steps": 4},
        "checkpoint": {"every_steps": 2},
    }


def metric_rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def sample_prompts(run_dir, step):
    return [
        json.loads(line)["prompt"] for line in (run_dir / "samples" / f"step_{step}.jsonl").read_text().splitlines()
    ]


def test_a_resumed_curriculum_run_continues_at_the_same_levels_and_problems(tmp_path, long_tiny_dir):
    straight = build_config(gym_config(tmp_path, long_tiny_dir, "straight", 4))
    train(straight)
    first = build_config(gym_config(tmp_path, long_tiny_dir, "resumed", 2))
    train(first)
    train(build_config(gym_config(tmp_path, long_tiny_dir, "resumed", 4)), resume=True)
    a, b = metric_rows(straight.run_dir), metric_rows(first.run_dir)
    level = "curriculum/chain_sum/level"
    # a random model answers nothing right: each full window (4 chain_sum samples) lowers the level
    assert [r[level] for r in a] == [r[level] for r in b]
    assert a[0][level] <= 2 and [r[level] for r in a] == sorted((r[level] for r in a), reverse=True)
    for step in (3, 4):
        assert sample_prompts(straight.run_dir, step) == sample_prompts(first.run_dir, step)
    last = a[-1]
    for name in ("val/accuracy", "val/chain_sum/accuracy", "val/gcd/accuracy", "val/harder/accuracy",
                 "val/harder/chain_sum/accuracy", "accuracy/chain_sum"):  # fmt: skip
        assert name in last, name
    assert last["val/prompts"] == 10 and last["val/harder/prompts"] == 6
    saved = (first.run_dir / "config.yaml").read_text()
    assert "reasoning_gym:" in saved and "level: 3" in saved and "seed: 10" in saved


def eval_config(tmp_path, model_dir) -> str:
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "task_type": "add" if a % 2 else "odd"} for a in range(7)
            for b in range(3)]  # fmt: skip
    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "eval.yaml"
    config.write_text(json.dumps({
        "model": {"path": str(model_dir)},
        "data": {"train_files": [str(data)], "val_files": [str(data)]},
        "reward": {"components": [{"name": "digit", "type": "custom", "accuracy": True,
                                   "function": "tests.reward_fns:even_code_sum"}]},
        "rollout": {"max_tokens": 4},
    }))  # fmt: skip
    return str(config)


def test_eval_against_a_serve_rollout_url_equals_the_model_in_process(tmp_path, tiny_model_dir, capsys):
    from postrl.models.loading import load_causal_lm, load_tokenizer
    from postrl.rollout.native import NativeRolloutWorker
    from postrl.run.evaluate import SampledEval, run_eval
    from postrl.serve.batcher import EngineBatcher
    from postrl.serve.limits import ServerLimits
    from postrl.serve.openai_server import build_app
    from tests.test_serve import Server

    config = eval_config(tmp_path, tiny_model_dir)
    tokenizer = load_tokenizer(str(tiny_model_dir))
    batcher = EngineBatcher(NativeRolloutWorker.from_hf(load_causal_lm(str(tiny_model_dir)), tokenizer, seed=0))
    server = Server(build_app(batcher, tokenizer, "tiny", max_context=128, limits=ServerLimits(default_max_tokens=8)))
    try:
        sampling = SampledEval(n=4, ks=[1, 2, 4], url=server.url, as_json=True)
        run_eval(str(tiny_model_dir), None, None, None, config, None, None, sampling)
        remote = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    finally:
        server.stop()
        batcher.close()
    run_eval(str(tiny_model_dir), None, None, None, config, None, None, SampledEval(n=4, ks=[1, 2, 4], as_json=True))
    local = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    r, loc = remote["sets"]["heldout"], local["sets"]["heldout"]
    assert remote["model"] == server.url and r["prompts"] == 21
    assert r["greedy"] == loc["greedy"]  # the same weights answer the same greedy tokens
    assert r["per_task"]["add"]["greedy"] == loc["per_task"]["add"]["greedy"]
    assert loc["greedy"] in (10 / 21, 11 / 21)  # a mix of passes and fails (11 prompts' codes sum to an even number)
    for figures in (r, loc):
        p = figures["pass_at_k"]
        assert p["1"] == pytest.approx(figures["mean_at_n"])  # pass@1 is the mean correctness
        assert p["1"] <= p["2"] <= p["4"]
        assert set(figures["per_task"]) == {"add", "odd"}
