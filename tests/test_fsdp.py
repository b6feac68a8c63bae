"""A 2-rank FSDP2 train group (gloo, real processes) against one process: same loss, same
gradients, same weights after an update; a checkpoint written by 2 ranks resumes in 1."""

from __future__ import annotations

import pytest
import torch

from postrl.config.run import AlgorithmConfig, TrainConfig
from postrl.models.loading import load_causal_lm
from postrl.train.factory import PolicySpec
from postrl.train.group import TrainGroup, TrainWorkerDiedError
from postrl.train.rank import GroupSpec, TrainRank
from postrl.train.sharding import split_rows_by_tokens
from postrl.train.worker import PolicyTrainer
from postrl.types import Experience, ExperienceBatch
from postrl.workers.clients import client
from postrl.workers.net import free_port
from postrl.workers.process import ProcessHandle
from postrl.workers.roles import TrainWorker
from tests.fsdp_probe import GradProbe

TRAIN = TrainConfig(lr=1e-2, mini_batch_size=12, micro_batch_size=2, device="cpu")


def uneven_batch(pad_id: int) -> ExperienceBatch:
    """12 samples in 4 groups of 3 (a group shares its prompt), of different lengths."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 40, (3 + g * 2,), generator=gen).tolist() for g in range(4)]
    exps = []
    for i in range(12):
        r = 2 + (i * 5) % 7
        prompt = prompts[i // 3]
        response = torch.randint(4, 40, (r,), generator=gen).tolist()
        logprobs = (-torch.rand(r, generator=gen) * 3).tolist()
        exps.append(Experience(prompt, response, logprobs, 0.0, float(i % 3) - 1.0, 0, group_id=i // 3))
    return ExperienceBatch.from_experiences(exps, pad_id)


def group_of(n: int, model_dir, factory=TrainRank, train: TrainConfig = TRAIN) -> list[ProcessHandle]:
    spec = GroupSpec(world=n, master_addr="127.0.0.1", master_port=free_port(), timeout_s=60)
    policy = PolicySpec(str(model_dir), "float32", train, AlgorithmConfig(), temperature=1.0, seed=0)
    return [ProcessHandle(f"train rank {r}", factory, r, spec, policy) for r in range(n)]


def test_token_split_balances_tokens_and_keeps_groups(char_tokenizer):
    batch = uneven_batch(char_tokenizer.pad_token_id)
    parts = split_rows_by_tokens(batch, 2)
    assert sorted(torch.cat(parts).tolist()) == list(range(12))
    tokens = [int(batch.attention_mask[p].sum()) for p in parts]
    # groups cost 17, 22, 20, 25 tokens (the prompt once): 25 -> rank 0, 22 -> rank 1, 20 -> rank 1, 17 -> rank 0
    assert tokens == [66, 66] and [p.tolist() for p in parts] == [[0, 1, 2, 9, 10, 11], [3, 4, 5, 6, 7, 8]]
    for p in parts:
        assert set(p.tolist()) == {r for g in set(batch.group_ids[p].tolist()) for r in range(g * 3, g * 3 + 3)}
    # fewer groups than ranks: rows are dealt one by one, heaviest first
    one_group = batch.select(slice(0, 3))
    assert [p.tolist() for p in split_rows_by_tokens(one_group, 2)] == [[1], [0, 2]]  # 10 | 8 + 5 tokens


@pytest.mark.parametrize("micro_batch_tokens", [None, 30])
@pytest.mark.slow
def test_two_rank_loss_gradients_and_update_equal_one_process(tiny_model_dir, char_tokenizer, micro_batch_tokens):
    """Fixed micro-batches on one process against the group's, fixed or by a token budget (each rank
    packs its share: 42 tokens into 2 micro-batches)."""
    batch = uneven_batch(char_tokenizer.pad_token_id)
    single = PolicyTrainer(load_causal_lm(str(tiny_model_dir)), TRAIN, AlgorithmConfig(), seed=0)
    single.model.train()
    stats = single.accumulate_gradients(batch)
    want_grads = {n: p.grad.clone() for n, p in single.model.named_parameters()}
    single.optimization.optimizer.zero_grad(set_to_none=True)
    want_loss = float(stats.value("actor/loss")) / float(stats.value("tokens"))

    train = TRAIN.model_copy(update={"micro_batch_tokens": micro_batch_tokens})
    ranks = group_of(2, tiny_model_dir, GradProbe, train=train)
    try:
        assert [f.result(timeout=120) for f in [h.call_async("join") for h in ranks]] == [0, 1]  # together
        got = [h.call_async("gradients", batch) for h in ranks]
        (loss0, tokens0, grads), (loss1, tokens1, _) = [f.result(timeout=120) for f in got]
        assert loss0 == loss1 and tokens0 == float(stats.value("tokens"))
        assert abs(loss0 / tokens0 - want_loss) <= 1e-5
        assert grads.keys() == want_grads.keys()
        worst = max(float((grads[n] - want_grads[n]).abs().max()) for n in grads)
        assert worst <= 1e-5, worst
        assert max(float(g.abs().max()) for g in grads.values()) > 1e-3  # gradients are not trivially zero
    finally:
        for h in ranks:
            h.close()


@pytest.mark.slow
def test_group_update_matches_one_process_and_checkpoint_resumes_in_one(tiny_model_dir, char_tokenizer, tmp_path):
    batch = uneven_batch(char_tokenizer.pad_token_id)
    train = TRAIN.model_copy(update={"mini_batch_size": 6, "forward": "transformers"})  # the ranks' forward
    single = PolicyTrainer(load_causal_lm(str(tiny_model_dir)), train, AlgorithmConfig(), seed=0)
    want = single.update(batch)
    group = client(TrainGroup(group_of(2, tiny_model_dir, train=train)), TrainWorker)
    try:
        got = group.update(batch)
        assert got.optimizer_steps == want.optimizer_steps == 2
        assert abs(got.get("actor/loss") - want.get("actor/loss")) <= 1e-5
        assert abs(got.get("actor/grad_norm") - want.get("actor/grad_norm")) <= 1e-4
        state = group.policy_state()
        diff = max(float((state[n] - t).abs().max()) for n, t in single.model.state_dict().items() if n in state)
        assert diff <= 1e-5, diff
        group.save_checkpoint(tmp_path / "ckpt")
    finally:
        group.close()
    # the DCP checkpoint of 2 ranks, resumed by one plain process: identical weights and optimizer
    resumed = PolicyTrainer(load_causal_lm(str(tiny_model_dir)), train, AlgorithmConfig(), seed=0)
    resumed.load_checkpoint(tmp_path / "ckpt")
    for name, tensor in resumed.model.state_dict().items():
        if name in state:
            assert torch.equal(tensor, state[name]), name
    assert resumed.optimization.steps == 2
    moments = [resumed.optimization.optimizer.state[p]["exp_avg"] for p in resumed.model.parameters()]
    assert all(float(m.abs().sum()) > 0 for m in moments)
    reloaded = load_causal_lm(str(tmp_path / "ckpt" / "model"))  # the gathered model/ folder loads too
    assert all(torch.equal(reloaded.state_dict()[n], state[n]) for n in state)


@pytest.mark.slow
def test_a_dead_rank_stops_the_group_naming_it(tiny_model_dir, char_tokenizer):
    ranks = group_of(2, tiny_model_dir)
    group = client(TrainGroup(ranks), TrainWorker)
    ranks[1].kill()
    with pytest.raises(TrainWorkerDiedError, match="train rank 1"):
        group.update(uneven_batch(char_tokenizer.pad_token_id))
    assert not any(h.alive() for h in ranks)


@pytest.mark.slow
def test_train_run_on_two_ranks_resumes_on_one(tmp_path, tiny_model_dir, arithmetic_jsonl):
    """`scheduler.train.workers=2` through the runner, then `--resume` with one process: the
    resumed run starts from the 2-rank checkpoint's exact weights."""
    from postrl.config.loading import build_config
    from postrl.run.checkpoint import latest_checkpoint
    from postrl.run.place import resume_config
    from postrl.run.train_runner import train

    settings = {
        "name": "fsdp",
        "output_dir": str(tmp_path),
        "steps": 2,
        "prompts_per_step": 4,
        "model": {"path": str(tiny_model_dir)},
        "data": {"train_files": [str(arithmetic_jsonl)]},
        "rollout": {"n": 4, "max_tokens": 8, "device": "cpu"},
        "reward": {"components": [{"type": "custom", "name": "digits", "function": "tests.reward_fns:digit_share"}]},
        "train": {"lr": 1e-2, "mini_batch_size": 16, "micro_batch_size": 4, "device": "cpu"},
        "checkpoint": {"every_steps": 1},
        "logging": {"trackers": ["jsonl"]},
        "scheduler": {"train": {"workers": 2}},
    }
    controller = train(build_config(settings)).controller
    assert controller.step_count == 2
    checkpoint = latest_checkpoint(tmp_path / "fsdp")
    saved = load_causal_lm(str(checkpoint / "model")).state_dict()
    final = load_causal_lm(str(tmp_path / "fsdp" / "final_model")).state_dict()
    assert all(torch.equal(saved[n], final[n]) for n in saved)
    assert any(not torch.equal(saved[n], t) for n, t in load_causal_lm(str(tiny_model_dir)).state_dict().items())
    # one process takes the 2-rank checkpoint: with no step left to run, final_model is what it loaded
    (tmp_path / "fsdp" / "final_model" / "model.safetensors").unlink()
    same = train(resume_config(tmp_path / "fsdp", ["scheduler.train.workers=1"]), resume=True).controller
    assert same.step_count == 2 and isinstance(same.parts.trainer.handle.obj, PolicyTrainer)  # one in-process worker
    reloaded = load_causal_lm(str(tmp_path / "fsdp" / "final_model")).state_dict()
    assert all(torch.equal(saved[n], reloaded[n]) for n in saved)
    more = train(resume_config(tmp_path / "fsdp", ["steps=3", "scheduler.train.workers=1"]), resume=True).controller
    assert more.step_count == 3


@pytest.mark.parametrize("loss_agg", ["seq_mean_token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.slow
def test_sequence_aggregations_are_exact_across_ranks(tiny_model_dir, char_tokenizer, loss_agg):
    """The sequence normalisers are global too: 2 ranks give the one-process update."""
    batch = uneven_batch(char_tokenizer.pad_token_id)
    train = TRAIN.model_copy(update={"mini_batch_size": 6})
    algorithm = AlgorithmConfig(loss_agg=loss_agg)
    single = PolicyTrainer(load_causal_lm(str(tiny_model_dir)), train, algorithm, seed=0)
    want = single.update(batch)
    spec = GroupSpec(world=2, master_addr="127.0.0.1", master_port=free_port(), timeout_s=60)
    policy = PolicySpec(str(tiny_model_dir), "float32", train, algorithm, temperature=1.0, seed=0)
    group = client(
        TrainGroup([ProcessHandle(f"train rank {r}", TrainRank, r, spec, policy) for r in range(2)]), TrainWorker
    )
    try:
        got = group.update(batch)
        assert abs(got.get("actor/grad_norm") - want.get("actor/grad_norm")) <= 1e-4
        state = group.policy_state()
        diff = max(float((state[n] - t).abs().max()) for n, t in single.model.state_dict().items() if n in state)
        assert diff <= 1e-5, diff
    finally:
        group.close()


@pytest.mark.slow
def test_lora_group_update_equals_one_process_and_resumes_in_one(tiny_model_dir, char_tokenizer, tmp_path):
    """LoRA under FSDP2: 2 ranks (base weights and adapters sharded together) take the one-process
    update; the gathered adapter sync, the peft export and the checkpoint (resumed by one process)
    all hold the same adapters."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from postrl.config.run import LoraConfig
    from postrl.train.factory import build_train_worker
    from postrl.train.lora import adapter_state

    batch = uneven_batch(char_tokenizer.pad_token_id)
    train = TRAIN.model_copy(update={"mini_batch_size": 6, "forward": "transformers"})
    lora = LoraConfig(r=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"], export="adapter")
    spec = PolicySpec(str(tiny_model_dir), "float32", train, AlgorithmConfig(kl_beta=0.1), 1.0, seed=0, lora=lora)
    torch.manual_seed(0)  # as each rank does before it builds its worker: the same adapter initialisation
    single = build_train_worker(spec, torch.device("cpu"))
    initial = {k: t.clone() for k, t in adapter_state(single.model).items()}
    want = single.update(batch)
    want_state = adapter_state(single.model)
    group_spec = GroupSpec(world=2, master_addr="127.0.0.1", master_port=free_port(), timeout_s=60)
    group = client(
        TrainGroup([ProcessHandle(f"train rank {r}", TrainRank, r, group_spec, spec) for r in range(2)]), TrainWorker
    )
    try:
        got = group.update(batch)
        assert got.optimizer_steps == want.optimizer_steps == 2
        assert abs(got.get("actor/loss") - want.get("actor/loss")) <= 1e-5
        assert abs(got.get("actor/kl") - want.get("actor/kl")) <= 1e-6 and got.get("actor/kl") > 0
        state = group.policy_state()
        assert state.keys() == want_state.keys() and all(k.endswith(("lora_A", "lora_B", "lora_scale")) for k in state)
        diff = max(float((state[k] - want_state[k]).abs().max()) for k in state)
        assert diff <= 1e-5, diff
        moved = max(float((state[k] - initial[k]).abs().max()) for k in state if k.endswith("lora_B"))
        assert moved > 1e-3  # B starts at 0: the update reached the adapters
        group.save_checkpoint(tmp_path / "ckpt")
        group.save_pretrained(tmp_path / "final")
    finally:
        group.close()
    torch.manual_seed(1)  # another initialisation: the checkpoint must bring the trained adapters
    resumed = build_train_worker(spec, torch.device("cpu"))
    resumed.load_checkpoint(tmp_path / "ckpt")
    again = adapter_state(resumed.model)
    assert all(torch.equal(again[k], state[k]) for k in state)
    assert resumed.optimization.steps == 2
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "final")
    ids = torch.tensor([char_tokenizer("12+34=")["input_ids"]])
    with torch.no_grad():
        assert float((peft(input_ids=ids).logits - single.model(input_ids=ids).logits).abs().max()) < 1e-5


@pytest.mark.slow
def test_lora_train_run_on_two_ranks_syncs_adapters_and_resumes_on_one(tmp_path, tiny_model_dir, arithmetic_jsonl):
    """`model.lora` with `scheduler.train.workers=2` through the runner: the engine applies the
    adapters the group gathered (its logprobs equal the trainer's), the merged export (gathered
    base weights plus the adapters) loads in transformers, and one process resumes the run from
    the 2-rank checkpoint."""
    import json

    from transformers import AutoModelForCausalLM

    from postrl.config.loading import build_config
    from postrl.run.place import resume_config
    from postrl.run.train_runner import train

    settings = {
        "name": "fsdp-lora",
        "output_dir": str(tmp_path),
        "steps": 2,
        "prompts_per_step": 4,
        "model": {"path": str(tiny_model_dir), "lora": {"r": 4, "alpha": 8, "export": "merged"}},
        "data": {"train_files": [str(arithmetic_jsonl)]},
        "rollout": {"n": 4, "max_tokens": 8, "device": "cpu"},
        "reward": {"components": [{"type": "custom", "name": "digits", "function": "tests.reward_fns:digit_share"}]},
        "algorithm": {"kl_beta": 0.05},
        "train": {"lr": 3e-2, "mini_batch_size": 16, "micro_batch_size": 4, "device": "cpu"},
        "checkpoint": {"every_steps": 1},
        "logging": {"trackers": ["jsonl"]},
        "scheduler": {"train": {"workers": 2}},
    }
    assert train(build_config(settings)).completed_steps == 2
    run = tmp_path / "fsdp-lora"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["actor/kl"] > 0  # step 2 trains on samples of the synced adapters, off the base model
    assert max(r["rollout/logprob_diff_max"] for r in rows) < 1e-4  # and the engine computed what the ranks do
    merged = AutoModelForCausalLM.from_pretrained(run / "final_model").state_dict()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    moved = {n for n, t in merged.items() if not torch.equal(t, base[n])}
    assert moved and all(
        n.endswith("_proj.weight") for n in moved
    )  # the adapted projections; norms, embeddings as they were
    more = train(resume_config(run, ["steps=3", "scheduler.train.workers=1"]), resume=True).controller
    assert more.step_count == 3
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["rollout/logprob_diff_max"] < 1e-4
