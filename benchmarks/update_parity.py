"""One GRPO update by postrl and by TRL's GRPOTrainer (1.16), from the same weights on the same batch.

Both sides start from the same tiny random Llama (float32) and train on the same batch: 4 prompts of
different lengths (TRL left-pads them, postrl packs them) x G=4 completions of 2-12 tokens, some
ending in EOS and some truncated at the 12-token budget, with fixed rewards (one group's all equal). TRL gets the completions from a
``rollout_func`` (its documented hook for an external generator) and the rewards from a reward
function; postrl gets them as Experiences, its advantages from its registry and its update from
``PolicyTrainer.update``. Each TRL ``loss_type`` is matched with its postrl equivalent:

    grpo    -> loss_agg seq_mean_token_mean    bnpo -> token_mean (one micro-batch: TRL's bnpo
    dr_grpo -> seq_mean_token_sum_norm                 normalises by each micro-batch's tokens)
    dapo    -> token_mean

and each reward scaling (TRL ``scale_rewards``) with postrl's GRPO advantage options: ``group`` ->
``grpo`` with ``eps: 1e-4`` (TRL's), ``none`` -> ``norm_by_std: false``. Both sides clip the gradient
to norm 1 and take one AdamW step (lr 1e-3, betas 0.9/0.999, eps 1e-8, no weight decay). Measured:
the loss (the scalar whose gradient is taken), the gradients the optimizer steps with (after the
clip), and the weights after the step:

- ``loss_rel_diff``: |loss_postrl - loss_trl| / max(|loss_trl|, 1e-12)
- ``grad_rel_diff``: ||g_postrl - g_trl|| / ||g_trl|| over all parameters; ``grad_cosine`` of the flattened gradients
- ``weights_rel_diff``: ||dW_postrl - dW_trl|| / ||dW_trl||, dW the step's change of the weights

    python benchmarks/update_parity.py [--json] [--smoke]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import tempfile
from dataclasses import dataclass, field

import torch
from _smoke import add_smoke, skip

from postrl.tasks.char_tokenizer import build_char_tokenizer

PROMPTS, G, MAX_TOKENS, LR = 4, 4, 12, 1e-3
# TRL loss_type -> postrl loss_agg
LOSS_TYPES = {
    "grpo": "seq_mean_token_mean",
    "bnpo": "token_mean",
    "dr_grpo": "seq_mean_token_sum_norm",
    "dapo": "token_mean",
}
SCALES = ("group", "none")
# micro-batches per optimizer step; TRL's bnpo normalises per micro-batch, so it is compared with one
MICRO_BATCHES = {"grpo": (1, 2), "bnpo": (1,), "dr_grpo": (1, 2), "dapo": (1, 2)}
BOUND = 1e-5


@dataclass
class Case:
    """The batch both sides train on, and the starting weights."""

    prompts: list[str]
    prompt_ids: list[list[int]]
    completions: list[list[list[int]]]  # [prompt][sample] token ids
    rewards: list[list[float]]
    state: dict[str, torch.Tensor] = field(repr=False)
    seed: int = 0


def tiny_llama(tokenizer, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config).float()


def make_case(seed: int = 0) -> Case:
    """Prompts of different lengths; completions that end in EOS or are cut at MAX_TOKENS; rewards in
    {0, 0.5, 1} with the last group's all equal (its advantages are 0 on both sides)."""
    tokenizer = build_char_tokenizer()
    gen = torch.Generator().manual_seed(seed)
    prompts = [f"{3 + 41 * i**3}+{4 + 7 * i}=" for i in range(PROMPTS)]
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
    special = set(tokenizer.all_special_ids)
    ordinary = torch.tensor([t for t in range(len(tokenizer)) if t not in special])
    completions, rewards = [], []
    for p in range(PROMPTS):
        group, scores = [], []
        for _ in range(G):
            stops = bool(torch.rand((), generator=gen) < 0.6)
            length = int(torch.randint(2, MAX_TOKENS + 1, (), generator=gen)) if stops else MAX_TOKENS
            ids = ordinary[torch.randint(len(ordinary), (length,), generator=gen)].tolist()
            if stops:
                ids[-1] = tokenizer.eos_token_id
            group.append(ids)
            scores.append(1.0 if p == PROMPTS - 1 else float(torch.randint(3, (), generator=gen)) / 2)
        completions.append(group)
        rewards.append(scores)
    state = {k: v.clone() for k, v in tiny_llama(tokenizer, seed).state_dict().items()}
    return Case(prompts, prompt_ids, completions, rewards, state, seed)


@dataclass
class UpdateResult:
    loss: float
    grads: dict[str, torch.Tensor]  # by parameter name, after the clip, as the optimizer stepped with them
    weights: dict[str, torch.Tensor]  # after the step
    grad_norm: float  # before the clip


def _fresh_model(case: Case):
    tokenizer = build_char_tokenizer()
    model = tiny_llama(tokenizer, case.seed)
    model.load_state_dict(case.state)
    return model, tokenizer


def postrl_update(
    case: Case, loss_type: str, scale: str, micro_batches: int, loss_agg: str | None = None, forward: str = "lean"
) -> UpdateResult:
    """postrl's update: advantages from the registry, then ``PolicyTrainer.update``. The old policy
    is the trainer's own forward (``old_logprobs: recompute``, no importance correction), as TRL's
    is with one iteration per batch: the ratio starts at exactly 1 on both sides. ``loss_agg``
    overrides the aggregation matched to ``loss_type`` (the benchmark's control)."""
    from postrl.algorithms import ADVANTAGES, AdvantageInputs
    from postrl.config.run import AlgorithmConfig, TrainConfig
    from postrl.train.worker import PolicyTrainer
    from postrl.types import Experience, ExperienceBatch

    model, tokenizer = _fresh_model(case)
    advantage = {"type": "grpo", "eps": 1e-4} if scale == "group" else {"type": "grpo", "norm_by_std": False}
    algorithm = AlgorithmConfig(
        advantage=advantage,
        loss_agg=loss_agg or LOSS_TYPES[loss_type],
        kl_beta=0.0,
        old_logprobs="recompute",
        importance={"type": "none"},
    )
    size = PROMPTS * G
    train = TrainConfig(
        lr=LR,
        mini_batch_size=size,
        micro_batch_size=size // micro_batches,
        precision="float32",
        grad_clip=1.0,
        forward=forward,
    )
    trainer = PolicyTrainer(
        model, train, algorithm, max_response_tokens=MAX_TOKENS, seed=case.seed, proximal="recompute"
    )
    rewards = torch.tensor([r for group in case.rewards for r in group])
    groups = torch.arange(PROMPTS).repeat_interleave(G)
    entry = algorithm.advantage
    adv = ADVANTAGES.get(entry.type)(AdvantageInputs(rewards, groups), **entry.options())
    experiences = []
    for p, group in enumerate(case.completions):
        for s, ids in enumerate(group):
            row = p * G + s
            logprobs = _own_logprobs(model, case.prompt_ids[p], ids)
            experiences.append(
                Experience(case.prompt_ids[p], ids, logprobs, float(rewards[row]), float(adv[row]), 0, group_id=p)
            )
    batch = ExperienceBatch.from_experiences(experiences, tokenizer.pad_token_id)
    losses: list[torch.Tensor] = []
    aggregate = trainer.aggregate

    def recorded(per_token, mask, norm):
        out = aggregate(per_token, mask, norm)
        losses.append(out.detach())
        return out

    trainer.aggregate = recorded
    grads: dict[str, torch.Tensor] = {}
    names = {id(p): n for n, p in model.named_parameters()}

    def capture(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    grads[names[id(p)]] = p.grad.detach().clone()

    trainer.optimization.optimizer.register_step_pre_hook(capture)
    metrics = trainer.update(batch)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return UpdateResult(float(sum(losses)), grads, weights, metrics.values["actor/grad_norm"])


@torch.no_grad()
def _own_logprobs(model, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
    """The policy's logprobs of the response (what an exact engine reports): the ratio starts at 1, as TRL's does."""
    ids = torch.tensor([prompt_ids + response_ids])
    logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response_ids)[:, None])[:, 0].tolist()


def trl_update(case: Case, loss_type: str, scale: str, micro_batches: int) -> UpdateResult:
    """TRL's GRPOTrainer for one step, the completions from a ``rollout_func``."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from transformers import PrinterCallback, ProgressCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model, tokenizer = _fresh_model(case)
    by_prompt = {p: i for i, p in enumerate(case.prompts)}
    reward_of: dict[tuple[str, tuple[int, ...]], float] = {}
    for p, prompt in enumerate(case.prompts):
        for s, ids in enumerate(case.completions[p]):
            reward_of[(prompt, tuple(ids))] = case.rewards[p][s]

    def rollout(prompts: list[str], trainer) -> dict:
        seen: dict[str, int] = {}
        out: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for prompt in prompts:
            k = seen.get(prompt, 0)
            seen[prompt] = k + 1
            ids = case.completions[by_prompt[prompt]][k]
            out["prompt_ids"].append(case.prompt_ids[by_prompt[prompt]])
            out["completion_ids"].append(ids)
            out["logprobs"].append([0.0] * len(ids))
        return out

    def reward(prompts, completions, completion_ids, **kwargs) -> list[float]:
        return [reward_of[(p, tuple(ids))] for p, ids in zip(prompts, completion_ids)]

    losses: list[float] = []
    captured: dict[str, torch.Tensor] = {}
    norms: list[float] = []

    class Capture(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            for n, p in model.named_parameters():
                if p.grad is not None:
                    captured[n] = p.grad.detach().clone()

    size = PROMPTS * G
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out,
            learning_rate=LR,
            per_device_train_batch_size=size // micro_batches,
            gradient_accumulation_steps=micro_batches,
            num_generations=G,
            max_completion_length=MAX_TOKENS,
            loss_type=loss_type,
            scale_rewards=scale,
            beta=0.0,
            max_steps=1,
            bf16=False,
            use_cpu=True,
            gradient_checkpointing=False,
            report_to=[],
            logging_steps=1,
            save_strategy="no",
            seed=case.seed,
            data_seed=case.seed,
            disable_tqdm=True,
        )
        dataset = Dataset.from_list([{"prompt": p} for p in case.prompts])
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            rollout_func=rollout,
            callbacks=[Capture()],
        )
        trainer.remove_callback(PrinterCallback)  # its per-step log lines would bury the table
        trainer.remove_callback(ProgressCallback)
        compute_loss = trainer.compute_loss

        def recorded(*a, **kw):
            loss = compute_loss(*a, **kw)
            losses.append(float(loss.detach()))
            return loss

        trainer.compute_loss = recorded
        clip = trainer._clip_grad_norm

        def clip_recorded(m):
            norm = clip(m)
            norms.append(float(norm))
            return norm

        trainer._clip_grad_norm = clip_recorded
        trainer.train()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return UpdateResult(sum(losses), captured, weights, norms[0] if norms else float("nan"))


def loss_scale(case: Case, scale: str) -> float:
    """The size of the loss's terms: the mean |advantage| over the samples. At ratio 1 the loss is
    -(aggregated advantages), which a group's centring makes (nearly) 0, so the loss's own size is
    no yardstick for its error."""
    rewards = torch.tensor(case.rewards, dtype=torch.float64)
    adv = rewards - rewards.mean(dim=1, keepdim=True)
    if scale == "group":
        adv = adv / (rewards.std(dim=1, keepdim=True) + 1e-4)
    return float(adv.abs().mean())


def compare(case: Case, scale: str, ours: UpdateResult, theirs: UpdateResult) -> dict[str, float]:
    names = sorted(theirs.grads)
    if sorted(ours.grads) != names:
        raise AssertionError(f"the two sides trained different parameters: {sorted(ours.grads)} vs {names}")
    g_ours = torch.cat([ours.grads[n].double().flatten() for n in names])
    g_theirs = torch.cat([theirs.grads[n].double().flatten() for n in names])
    start = {n: case.state[n].double() for n in names if n in case.state}
    d_ours = torch.cat([(ours.weights[n].double() - start[n]).flatten() for n in start])
    d_theirs = torch.cat([(theirs.weights[n].double() - start[n]).flatten() for n in start])
    w_theirs = torch.cat([theirs.weights[n].double().flatten() for n in start])
    return {
        "loss_postrl": ours.loss,
        "loss_trl": theirs.loss,
        "loss_rel_diff": abs(ours.loss - theirs.loss) / max(abs(theirs.loss), loss_scale(case, scale)),
        "grad_rel_diff": float((g_ours - g_theirs).norm() / g_theirs.norm()),
        "grad_cosine": float(torch.nn.functional.cosine_similarity(g_ours, g_theirs, dim=0)),
        "grad_norm_postrl": ours.grad_norm,
        "grad_norm_trl": theirs.grad_norm,
        "weights_rel_diff": float((d_ours - d_theirs).norm() / w_theirs.norm()),
        "update_rel_diff": float((d_ours - d_theirs).norm() / d_theirs.norm()),
        "update_max_diff_in_lr": float((d_ours - d_theirs).abs().max() / LR),
    }


def variants(smoke: bool) -> list[tuple[str, str, int]]:
    runs = [(loss, scale, m) for loss in LOSS_TYPES for scale in SCALES for m in MICRO_BATCHES[loss]]
    return [("grpo", "group", 2), ("dapo", "none", 1)] if smoke else runs


def within_bounds(row: dict[str, float]) -> bool:
    return (
        row["loss_rel_diff"] <= BOUND
        and row["grad_rel_diff"] <= BOUND
        and row["grad_cosine"] >= 1 - BOUND
        and row["weights_rel_diff"] <= BOUND
    )


def run(smoke: bool, seed: int = 0, forward: str = "lean") -> dict:
    case = make_case(seed)
    rows = {}
    for loss, scale, micro in variants(smoke):
        key = f"{loss}/{scale}/micro{micro}"
        ours = postrl_update(case, loss, scale, micro, forward=forward)
        rows[key] = compare(case, scale, ours, trl_update(case, loss, scale, micro))
        rows[key]["ok"] = within_bounds(rows[key])
    return rows


def control(seed: int = 0) -> dict[str, float]:
    """A mismatched pair (postrl's GRPO-paper aggregation against TRL's dapo): the comparison must
    see it, or its bounds prove nothing."""
    case = make_case(seed)
    ours = postrl_update(case, "dapo", "group", 1, loss_agg="seq_mean_token_mean")
    return compare(case, "group", ours, trl_update(case, "dapo", "group", 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object on the last line")
    parser.add_argument("--seed", type=int, default=0, help="the weights, completions and rewards")
    parser.add_argument(
        "--forward", choices=["lean", "transformers"], default="lean", help="postrl's training forward (train.forward)"
    )
    add_smoke(parser)
    args = parser.parse_args()
    if importlib.util.find_spec("trl") is None:
        skip("TRL is not installed (pip install -e '.[bench]' or scripts/setup_bench.sh)", args.json)
        return
    torch.set_num_threads(1)  # the same reduction order on both sides, whatever the machine
    if not report(run(args.smoke, args.seed, args.forward), control(args.seed), args.json):
        sys.exit(1)


def report(rows: dict, wrong: dict[str, float], as_json: bool) -> bool:
    """The table, the worst figures and the control; with ``as_json`` the JSON line. True when every bound holds."""
    print(
        f"{'TRL loss_type/scale_rewards/micro-batches':<34}{'loss':>12}{'loss rel':>10}{'grad rel':>10}"
        f"{'grad cos':>12}{'weights rel':>12}{'update rel':>12}  ok"
    )
    for key, r in rows.items():
        print(
            f"{key:<34}{r['loss_trl']:>12.6f}{r['loss_rel_diff']:>10.1e}{r['grad_rel_diff']:>10.1e}"
            f"{r['grad_cosine']:>12.9f}{r['weights_rel_diff']:>12.1e}{r['update_rel_diff']:>12.1e}"
            f"  {'yes' if r['ok'] else 'NO'}"
        )
    worst = {
        "loss_rel_diff": max(r["loss_rel_diff"] for r in rows.values()),
        "grad_rel_diff": max(r["grad_rel_diff"] for r in rows.values()),
        "grad_cosine": min(r["grad_cosine"] for r in rows.values()),
        "weights_rel_diff": max(r["weights_rel_diff"] for r in rows.values()),
    }
    ok = all(r["ok"] for r in rows.values()) and all(math.isfinite(v) for v in worst.values())
    print(f"worst: {worst}; every variant within {BOUND:g}: {ok}")
    seen = wrong["grad_rel_diff"] > 100 * BOUND
    print(
        f"control (postrl seq_mean_token_mean against TRL dapo): grad rel {wrong['grad_rel_diff']:.1e}, "
        f"loss rel {wrong['loss_rel_diff']:.1e}: {'told apart' if seen else 'NOT TOLD APART'}"
    )
    ok = ok and seen
    if as_json:
        print(
            json.dumps(
                {
                    "variants": rows,
                    "worst": worst,
                    "control_grad_rel_diff": wrong["grad_rel_diff"],
                    "all_within_bounds": ok,
                    "bound": BOUND,
                }
            )
        )
    return ok


if __name__ == "__main__":
    main()
