from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from postrl.config.run import AlgorithmConfig, TrainConfig
from postrl.train.optimization import NonFiniteLossError
from postrl.train.worker import PolicyTrainer
from postrl.types import Experience, ExperienceBatch
from tests.conftest import make_tiny_model


def batch_of(tokenizer, advantages):
    exps = [Experience([1, 20, 21], [30, 31, 2], [-1.0, -1.2, -0.5], 1.0, a, 0) for a in advantages]
    return ExperienceBatch.from_experiences(exps, tokenizer.pad_token_id)


def test_experience_batch_alignment(char_tokenizer):
    exps = [
        Experience([1, 20], [30, 31, 2], [-1.0, -2.0, -3.0], 1.0, 0.5, 3),
        Experience([1, 20, 21, 22], [40], [-4.0], 0.0, -0.5, 3),
    ]
    b = ExperienceBatch.from_experiences(exps, char_tokenizer.pad_token_id)
    assert b.input_ids.tolist()[0] == [1, 20, 30, 31, 2]
    # the logprob of response token t sits at the position that predicts it
    assert b.response_mask.tolist() == [[0, 1, 1, 1], [0, 0, 0, 1]]
    assert b.old_logprobs.tolist() == [[0, -1, -2, -3], [0, 0, 0, -4]]
    assert b.num_tokens == 4 and b.weight_versions.tolist() == [3, 3]
    with pytest.raises(ValueError, match="2 logprobs for 1 response tokens"):
        ExperienceBatch.from_experiences([Experience([1], [2], [0.0, 0.0], 0.0, 0.0, 0)], 0)
    # sequence advantages broadcast over the response; samples without a group are groups of one
    assert b.advantages.tolist() == [[0, 0.5, 0.5, 0.5], [0, 0, 0, -0.5]]
    assert b.group_ids.tolist() == [0, 1] and b.loss_mask.tolist() == b.response_mask.tolist()
    assert b.logprob_versions.tolist() == [[-1, 3, 3, 3], [-1, -1, -1, 3]]


def test_experience_batch_carries_token_level_fields(char_tokenizer):
    exps = [
        Experience(
            [1, 20],
            [30, 31, 2],
            [-1.0, -2.0, -3.0],
            1.0,
            [0.1, 0.2, 0.3],
            4,
            group_id=7,
            loss_mask=[1, 0, 1],
            logprob_versions=[3, 3, 4],
        ),
        Experience([1, 20], [32], [-4.0], 0.0, -0.5, 4, group_id=7),
    ]
    b = ExperienceBatch.from_experiences(exps, char_tokenizer.pad_token_id)
    assert b.advantages[0].tolist() == pytest.approx([0, 0.1, 0.2, 0.3])
    assert b.loss_mask.tolist() == [[0, 1, 0, 1], [0, 1, 0, 0]] and b.num_tokens == 3
    assert b.response_mask.tolist() == [[0, 1, 1, 1], [0, 1, 0, 0]]
    assert b.logprob_versions.tolist() == [[-1, 3, 3, 4], [-1, 4, -1, -1]] and b.group_ids.tolist() == [7, 7]
    with pytest.raises(ValueError, match="experience 0 has no advantage"):
        ExperienceBatch.from_experiences([Experience([1], [2], [0.0], 0.0, None, 0)], 0)
    with pytest.raises(ValueError, match="experience 0: 2 advantages for 1 response tokens"):
        ExperienceBatch.from_experiences([Experience([1], [2], [0.0], 0.0, [1.0, 2.0], 0)], 0)
    with pytest.raises(ValueError, match="experience 0: 1 loss_mask entries for 2 response tokens"):
        ExperienceBatch.from_experiences([Experience([1], [2, 3], [0.0, 0.0], 0.0, 1.0, 0, loss_mask=[1])], 0)


def test_loss_mask_keeps_tokens_in_context_but_out_of_the_loss(char_tokenizer):
    """A masked token's advantage cannot move the gradient; it still conditions later tokens."""
    grads = []
    for masked_advantage in (100.0, -100.0):
        model = make_tiny_model("llama", char_tokenizer).double()
        worker = PolicyTrainer(model, TrainConfig(mini_batch_size=2, micro_batch_size=2), AlgorithmConfig())
        exps = [
            Experience(
                [1, 20, 21],
                [30, 31, 32],
                [-1.0, -1.0, -1.0],
                1.0,
                [1.0, masked_advantage, -0.5],
                0,
                group_id=0,
                loss_mask=[1, 0, 1],
            )
        ]
        model.train()
        worker.accumulate_gradients(ExperienceBatch.from_experiences(exps, char_tokenizer.pad_token_id))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1])
    assert grads[0].abs().sum() > 0


def test_group_shuffle_keeps_groups_together(char_tokenizer):
    exps = [Experience([1, 20 + g], [30], [-1.0], 1.0, 0.5, 0, group_id=g) for g in (3, 1, 3, 2, 1, 3)]
    batch = ExperienceBatch.from_experiences(exps, char_tokenizer.pad_token_id)
    worker = PolicyTrainer(make_tiny_model("llama", char_tokenizer), TrainConfig(), AlgorithmConfig(), seed=5)
    for _ in range(5):
        order = worker._group_shuffled_order(batch).tolist()
        groups = [exps[i].group_id for i in order]
        runs = [g for i, g in enumerate(groups) if i == 0 or groups[i - 1] != g]
        assert sorted(order) == list(range(6)) and sorted(runs) == [1, 2, 3]


def test_update_raises_the_good_response_and_lowers_the_bad_one(char_tokenizer):
    """Two responses to one prompt, advantage +1 and -1: after the update the first is more likely
    and the second less (a sign flip in the loss or the advantages fails here), and the metrics are
    those of real steps."""
    from postrl.train.logprobs import token_logprobs

    model = make_tiny_model("llama", char_tokenizer)

    def batch_with(old: list[list[float]]) -> ExperienceBatch:
        exps = [
            Experience([1, 20, 21], [30, 31, 32], old[0], 1.0, 1.0, 0, group_id=0),
            Experience([1, 20, 21], [40, 41, 42], old[1], 0.0, -1.0, 0, group_id=0),
        ]
        return ExperienceBatch.from_experiences(exps, char_tokenizer.pad_token_id)

    def logprobs(batch: ExperienceBatch) -> torch.Tensor:
        with torch.no_grad():
            logp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, target_mask=batch.response_mask)
        return logp

    def mean_logprobs() -> list[float]:
        logp = logprobs(batch)
        return ((logp * batch.response_mask).sum(-1) / batch.response_mask.sum(-1)).tolist()

    probe = batch_with([[0.0] * 3, [0.0] * 3])
    current = logprobs(probe)
    batch = batch_with([row[mask.bool()].tolist() for row, mask in zip(current, probe.response_mask)])  # on-policy
    before = mean_logprobs()
    worker = PolicyTrainer(model, TrainConfig(lr=1e-3, mini_batch_size=2, micro_batch_size=1), AlgorithmConfig())
    metrics = worker.update(batch)
    after = mean_logprobs()
    assert after[0] > before[0] + 0.01 and after[1] < before[1] - 0.01, (before, after)
    assert metrics.optimizer_steps == 1 and metrics.skipped_steps == 0
    assert metrics.get("actor/grad_norm") > 0 and metrics.get("actor/entropy") > 0
    assert 0 <= metrics.get("actor/clip_fraction") <= 1


def test_non_finite_gradient_skips_step_then_stops_the_run(char_tokenizer):
    model = make_tiny_model("llama", char_tokenizer)
    worker = PolicyTrainer(
        model, TrainConfig(lr=1e-2, mini_batch_size=4, micro_batch_size=4, max_consecutive_nan=2), AlgorithmConfig()
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = batch_of(char_tokenizer, [float("nan")] * 4)
    metrics = worker.update(bad)
    assert metrics.skipped_steps == 1 and metrics.optimizer_steps == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(NonFiniteLossError, match="2 updates in a row had a non-finite gradient norm"):
        worker.update(bad)


def test_save_checkpoint_writes_loadable_safetensors_and_optimizer(char_tokenizer, tmp_path):
    model = make_tiny_model("llama", char_tokenizer)
    worker = PolicyTrainer(model, TrainConfig(lr=1e-2, mini_batch_size=4, micro_batch_size=4), AlgorithmConfig())
    worker.update(batch_of(char_tokenizer, [1.0, -1.0, 1.0, -1.0]))
    worker.save_checkpoint(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model" / "model.safetensors").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "model")
    assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), model.state_dict().values()))
    state = torch.load(tmp_path / "ckpt" / "optimization.pt", weights_only=True)
    assert state["counters"] == [1, 0, 0]  # steps, skipped, skipped in a row
    fresh = PolicyTrainer(
        make_tiny_model("llama", char_tokenizer, seed=5),
        TrainConfig(lr=1e-2, mini_batch_size=4, micro_batch_size=4),
        AlgorithmConfig(),
    )
    fresh.load_checkpoint(tmp_path / "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(fresh.model.state_dict().values(), model.state_dict().values()))
    moments = [
        (worker.optimization.optimizer.state[p]["exp_avg_sq"], fresh.optimization.optimizer.state[q]["exp_avg_sq"])
        for p, q in zip(worker.model.parameters(), fresh.model.parameters())
    ]
    assert moments and all(torch.equal(a, b) and a.abs().sum() > 0 for a, b in moments)
    assert fresh.optimization.steps == 1


def test_kl_needs_reference_model(char_tokenizer):
    with pytest.raises(ValueError, match="needs a reference model"):
        PolicyTrainer(make_tiny_model("llama", char_tokenizer), TrainConfig(), AlgorithmConfig(kl_beta=0.1))


def test_gradient_checkpointing_gives_the_same_gradients(char_tokenizer):
    import copy

    base = make_tiny_model("llama", char_tokenizer).double()
    batch = batch_of(char_tokenizer, [1.0, -1.0, 0.5, -0.5])
    grads = []
    for checkpointing in (False, True):
        model = copy.deepcopy(base)
        worker = PolicyTrainer(
            model,
            TrainConfig(mini_batch_size=4, micro_batch_size=2),
            AlgorithmConfig(),
            gradient_checkpointing=checkpointing,
        )
        model.train()
        worker.accumulate_gradients(batch)
        grads.append([p.grad.clone() for p in model.parameters()])
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(*grads))


def test_bf16_autocast_training_keeps_fp32_weights_and_learns(char_tokenizer):
    """Under bf16 autocast the weights stay fp32 and move as the fp32 update moves them, but not
    bit for bit (the matmuls did run in bf16: a precision setting that did nothing fails here)."""
    results = {}
    for precision in ("bf16_autocast", "float32"):
        torch.manual_seed(0)
        model = make_tiny_model("llama", char_tokenizer)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        train = TrainConfig(lr=1e-2, mini_batch_size=4, micro_batch_size=2, precision=precision)
        metrics = PolicyTrainer(model, train, AlgorithmConfig()).update(
            batch_of(char_tokenizer, [1.0, -1.0, 0.5, -0.5])
        )
        assert metrics.optimizer_steps == 1 and metrics.get("actor/grad_norm") > 0
        assert all(v.dtype == torch.float32 for v in model.state_dict().values())
        results[precision] = {k: v - before[k] for k, v in model.state_dict().items()}
    bf16, fp32 = results["bf16_autocast"], results["float32"]
    moved = [k for k in fp32 if fp32[k].abs().max() > 0]
    assert moved and any(not torch.equal(bf16[k], fp32[k]) for k in moved)
    cos = torch.nn.functional.cosine_similarity(
        torch.cat([bf16[k].flatten() for k in moved]), torch.cat([fp32[k].flatten() for k in moved]), dim=0
    )
    assert cos > 0.9, float(cos)


def test_masked_logprobs_equal_full_logprobs_on_the_mask(char_tokenizer):
    from postrl.train.logprobs import token_logprobs

    model = make_tiny_model("qwen2", char_tokenizer).double()
    exps = [
        Experience([1, 20, 21, 22], [30, 31, 2], [-1.0, -1.0, -1.0], 1.0, 1.0, 0),
        Experience([1, 20], [40, 41, 42, 2], [-1.0] * 4, 1.0, -1.0, 0),
    ]
    b = ExperienceBatch.from_experiences(exps, char_tokenizer.pad_token_id)
    full, full_ent = token_logprobs(model, b.input_ids, b.attention_mask, 0.9, with_entropy="value")
    part, part_ent = token_logprobs(
        model, b.input_ids, b.attention_mask, 0.9, with_entropy="value", target_mask=b.response_mask
    )
    m = b.response_mask.bool()
    assert torch.allclose(full[m], part[m], atol=1e-12) and torch.allclose(full_ent[m], part_ent[m], atol=1e-12)
    assert (part[~m] == 0).all()


def test_training_attention_kernel_choice_gives_the_same_gradients(char_tokenizer):
    """auto picks eager on CPU; eager and sdpa must agree on the loss gradient."""
    grads = {}
    for choice in ("sdpa", "auto"):
        model = make_tiny_model("llama", char_tokenizer)
        worker = PolicyTrainer(
            model, TrainConfig(attention=choice, mini_batch_size=4, micro_batch_size=2), AlgorithmConfig()
        )
        assert model.config._attn_implementation == ("eager" if choice == "auto" else "sdpa")
        worker.accumulate_gradients(batch_of(char_tokenizer, [1.0, -1.0, 0.5, -0.5]))
        grads[choice] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    torch.testing.assert_close(grads["auto"], grads["sdpa"], atol=1e-6, rtol=1e-5)


def test_shared_prompt_packing_gives_the_unpacked_logprobs_and_gradients(char_tokenizer):
    from postrl.train.logprobs import pack_shared_prompts, token_logprobs

    exps = [
        Experience([1, 20, 21], [30, 31, 2], [0.0] * 3, 1.0, 0.5, 0, group_id=0),
        Experience([1, 20, 21], [32], [0.0], 1.0, -0.5, 0, group_id=0),
        Experience([1, 22, 23, 24], [33, 34], [0.0] * 2, 1.0, 1.0, 0, group_id=1),
        Experience([1, 20, 21], [35, 36, 37, 38, 2], [0.0] * 5, 1.0, 0.2, 0, group_id=0),
        Experience([1, 22, 23, 24], [39, 40, 41], [0.0] * 3, 1.0, -1.0, 0, group_id=1),
        Experience([1, 25], [42, 43], [0.0] * 2, 1.0, 0.3, 0, group_id=2),
    ]
    batch = ExperienceBatch.from_experiences(exps, char_tokenizer.pad_token_id)
    packed = pack_shared_prompts(batch.input_ids, batch.attention_mask, batch.response_mask, batch.group_ids)
    assert packed is not None and packed.input_ids.shape[0] == 3  # one packed row per distinct prompt
    results = {}
    for name in ("packed", "plain"):
        model = make_tiny_model("llama", char_tokenizer).float()
        model.set_attn_implementation("eager")
        if name == "packed":
            logp, ent = token_logprobs(
                model, batch.input_ids, batch.attention_mask, 0.7, "value", batch.response_mask, batch.group_ids
            )
        else:
            logp, ent = token_logprobs(model, batch.input_ids, batch.attention_mask, 0.7, "value")
            logp, ent = logp * batch.response_mask, ent * batch.response_mask
        (logp * batch.advantages).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results[name] = (logp.detach(), (ent * batch.response_mask).detach(), grads)
    torch.testing.assert_close(results["packed"][0], results["plain"][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results["packed"][1], results["plain"][1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results["packed"][2], results["plain"][2], atol=1e-5, rtol=1e-4)
    assert (results["packed"][0] != 0).sum() == batch.response_mask.sum()
    # nothing shared, or not a prompt+response layout: no packing
    assert (
        pack_shared_prompts(batch.input_ids[5:], batch.attention_mask[5:], batch.response_mask[5:], batch.group_ids[5:])
        is None
    )
    # rows of one group with different prompts (an episode's later samples) are packed apart
    merged = batch.group_ids.clone()
    merged[5:] = 0
    apart = pack_shared_prompts(batch.input_ids, batch.attention_mask, batch.response_mask, merged)
    grouped = pack_shared_prompts(batch.input_ids, batch.attention_mask, batch.response_mask, batch.group_ids)
    assert apart is not None and grouped is not None
    torch.testing.assert_close(apart.input_ids, grouped.input_ids)


def test_the_forward_is_chosen_in_one_dispatch_and_the_worker_reports_it(char_tokenizer, caplog):
    """plan_forward names the path that runs; each path gives the same logprobs; the worker logs
    the path of its forwards and counts them."""
    from postrl.train.logprobs import plan_forward, token_logprobs

    exps = [
        Experience([1, 20, 21], [30, 31, 2], [0.0] * 3, 1.0, 0.5, 0, group_id=0),
        Experience([1, 20, 21], [32], [0.0], 1.0, -0.5, 0, group_id=0),
        Experience([1, 22, 23, 24], [33, 34], [0.0] * 2, 1.0, 1.0, 0, group_id=1),
    ]
    b = ExperienceBatch.from_experiences(exps, char_tokenizer.pad_token_id)
    model = make_tiny_model("llama", char_tokenizer).float()
    ids, att, target, groups = b.input_ids, b.attention_mask, b.response_mask, b.group_ids
    paths = {
        "lean": plan_forward(model, ids, att, target, groups, lean=True),
        "shared_prompts": plan_forward(model, ids, att, target, groups, lean=False),
        "selected": plan_forward(model, ids, att, target, None, lean=False),
        "full": plan_forward(model, ids, att, None, groups, lean=True),
    }
    assert {name: plan.path for name, plan in paths.items()} == {name: name for name in paths}
    with torch.no_grad():
        results = {n: token_logprobs(model, ids, att, target_mask=target, plan=p)[0] for n, p in paths.items()}
    for name, logp in results.items():
        torch.testing.assert_close(logp * target, results["full"] * target, atol=1e-5, rtol=1e-5, msg=name)
    worker = PolicyTrainer(model, TrainConfig(mini_batch_size=3, micro_batch_size=3), AlgorithmConfig())
    with caplog.at_level("INFO", logger="postrl.train.worker"):
        worker.update(b)
    assert dict(worker.forward_paths) == {"lean": 1}
    assert "train forward: lean" in caplog.text
