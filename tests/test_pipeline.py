"""The step as a pipeline: one StepBatch built after scoring, stages that add to it, the buffer as
the seam, and tests that fail when the update itself is wrong (sign, dtype, resume)."""

from __future__ import annotations

import pytest
import torch

from postrl.config.loading import build_config
from postrl.config.run import AlgorithmConfig, TrainConfig
from postrl.train.logprobs import token_logprobs
from postrl.train.worker import PolicyTrainer
from postrl.types import Experience, ExperienceBatch, Health, Prompt, RewardResult, Rollout, StepBatch
from tests.conftest import make_tiny_model


def rollouts() -> tuple[list[Prompt], list[Rollout], list[RewardResult]]:
    prompts = [Prompt("a", [1, 20], {"task_type": "math", "answer": "4"}), Prompt("b", [1, 21, 22])]
    out = [
        Rollout(0, [1, 20], [30, 31], [-0.5, -0.25], "x", "stop", 3, engine="rollout engine 0"),
        Rollout(0, [1, 20], [32], [-1.0], "y", "length", 3, logprob_versions=[2]),
        Rollout(1, [1, 21, 22], [33, 34, 2], [-0.1, -0.2, -0.3], "z", "stop", 3),
    ]
    return prompts, out, [RewardResult(1.0), RewardResult(None, error="boom"), RewardResult(0.5)]


def test_step_batch_is_built_once_in_the_training_layout():
    prompts, rs, results = rollouts()
    step = StepBatch.build(prompts, rs, results, pad_id=0, generated_at=10.0, scored_at=11.0)
    b = step.batch
    assert b.input_ids.tolist() == [[1, 20, 30, 31, 0, 0], [1, 20, 32, 0, 0, 0], [1, 21, 22, 33, 34, 2]]
    assert b.response_mask.tolist() == [[0, 1, 1, 0, 0], [0, 1, 0, 0, 0], [0, 0, 1, 1, 1]]
    assert b.loss_mask.tolist() == [[0, 1, 1, 0, 0], [0, 0, 0, 0, 0], [0, 0, 1, 1, 1]]  # unscorable: no weight
    assert b.old_logprobs[0].tolist() == [0, -0.5, -0.25, 0, 0]
    assert b.logprob_versions.tolist() == [[-1, 3, 3, -1, -1], [-1, 2, -1, -1, -1], [-1, -1, 3, 3, 3]]
    assert b.group_ids.tolist() == [0, 0, 1] and b.weight_versions.tolist() == [3, 3, 3]
    assert step.rewards[0] == 1.0 and torch.isnan(step.rewards[1]) and step.unscorable.tolist() == [False, True, False]
    step.set_advantages(torch.tensor([2.0, 0.0, -1.0]))
    assert b.advantages.tolist() == [[0, 2, 2, 0, 0], [0, 0, 0, 0, 0], [0, 0, -1, -1, -1]]
    assert step.advantage_of(0) == 2.0 and step.advantage_of(2) == -1.0
    # the buffer's per-sample views collate back into the very same tensors
    exps = step.experiences()
    again = ExperienceBatch.from_experiences(exps, pad_id=0)
    for name in ("input_ids", "attention_mask", "response_mask", "loss_mask", "old_logprobs", "advantages"):
        assert torch.equal(getattr(again, name), getattr(b, name)), name
    assert exps[0].metadata == {
        "task_type": "math",
        "source": "",
        "engine": "rollout engine 0",
        "finish_reason": "stop",
        "generated_at": 10.0,
        "scored_at": 11.0,
        "row": 0,
        "components": {},
        "reasons": {},
        "error": None,
    }
    assert exps[1].metadata["error"] == "boom" and exps[1].loss_mask == [0]


def test_prompt_fields_split_and_health_as_a_bool():
    prompts, rs, results = rollouts()
    assert (prompts[0].task_type, prompts[0].answer) == ("math", "4") and prompts[1].task_type is None
    assert prompts[1].answer is None
    batch = StepBatch.build(prompts, rs, results, pad_id=0).batch
    parts = batch.split(2)
    assert [p.size for p in parts] == [2, 1] and torch.equal(parts[1].input_ids, batch.input_ids[2:])
    with pytest.raises(ValueError, match="mini_batch_size must be >= 1"):
        batch.split(0)
    assert not Health(False, "no KV cache") and Health(True)


def test_build_components_works_on_a_default_config():
    from postrl.run.train_job import close_components
    from postrl.run.train_runner import build_components

    config = build_config({})
    parts = build_components(config)
    try:
        assert parts.config.data.max_prompt_tokens == 64  # the demo model's context 128 minus rollout.max_tokens 64
        assert config.data.max_prompt_tokens is None  # the given config is left as it was
        assert len(parts.prompts.train()) == 5000 and parts.critic is None
    finally:
        close_components(parts)


def one_update(tokenizer, advantage: float, precision: str = "float32", lr: float = 1e-2):
    """One PPO-clip update on one sample whose behaviour logprobs are the policy's own (ratio 1)."""
    torch.manual_seed(0)
    model = make_tiny_model("llama", tokenizer)
    worker = PolicyTrainer(model, TrainConfig(lr=lr, precision=precision, grad_clip=1e9), AlgorithmConfig())
    prompt, response = [1, 20, 21], [30, 31, 2]
    probe = ExperienceBatch.from_experiences([Experience(prompt, response, [0.0] * 3, 0.0, 0.0, 0)], 0)
    with torch.no_grad():
        before, _ = token_logprobs(model, probe.input_ids, probe.attention_mask, target_mask=probe.response_mask)
    behaviour = before[0, probe.response_mask[0].bool()].tolist()
    batch = ExperienceBatch.from_experiences([Experience(prompt, response, behaviour, 1.0, advantage, 0)], 0)
    metrics = worker.update(batch)
    with torch.no_grad():
        after, _ = token_logprobs(model, probe.input_ids, probe.attention_mask, target_mask=probe.response_mask)
    gain = float(((after - before) * probe.response_mask).sum())
    return metrics, gain


def test_one_update_has_the_hand_computed_loss_and_moves_towards_the_advantage(char_tokenizer):
    # ratio 1 on every token: the clipped surrogate is -A x 1 per token, token-mean -A
    up, gain_up = one_update(char_tokenizer, advantage=0.5)
    down, gain_down = one_update(char_tokenizer, advantage=-0.5)
    assert up.get("actor/loss") == pytest.approx(-0.5, abs=1e-6)
    assert down.get("actor/loss") == pytest.approx(0.5, abs=1e-6)
    assert up.get("actor/clip_fraction") == 0.0 and up.optimizer_steps == 1
    assert gain_up > 1e-3 and gain_down < -1e-3  # a flipped loss sign would swap these


def test_bf16_autocast_computes_the_forward_in_bf16(char_tokenizer):
    seen: dict[str, set] = {}
    for precision in ("float32", "bf16_autocast"):
        torch.manual_seed(0)
        model = make_tiny_model("llama", char_tokenizer)
        dtypes: set = set()
        layer = model.model.layers[0].mlp.down_proj
        layer.register_forward_hook(lambda _m, _i, out, dtypes=dtypes: dtypes.add(out.dtype))
        worker = PolicyTrainer(model, TrainConfig(precision=precision), AlgorithmConfig())
        batch = ExperienceBatch.from_experiences([Experience([1, 20], [30, 2], [-1.0, -1.0], 1.0, 1.0, 0)], 0)
        worker.update(batch)
        seen[precision] = dtypes
        assert next(model.parameters()).dtype == torch.float32  # the master weights stay fp32
    assert seen == {"float32": {torch.float32}, "bf16_autocast": {torch.bfloat16}}


@pytest.mark.slow
def test_remote_errors_arrive_typed_from_a_child_process():
    from postrl.models.weights import WeightSyncError
    from postrl.workers.errors import WorkerCallError
    from postrl.workers.process import ProcessHandle
    from tests.engine_hosts import Refusing

    handle = ProcessHandle("rollout engine 3", Refusing)
    try:
        with pytest.raises(WeightSyncError, match="^rollout engine 3 in update_weights: manifest mismatch"):
            handle.call("update_weights", {}, 1, timeout=60)
        with pytest.raises(WorkerCallError, match="(?s)rollout engine 3 failed in broken:.*KeyError: 'no such tensor'"):
            handle.call("broken", timeout=60)
        assert handle.attribute("accuracy_component") == "acc" and handle.alive()  # still serving
    finally:
        handle.close()
