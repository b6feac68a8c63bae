"""rollout.exact: the native engine's logprobs equal the trainer's recomputation bit for bit.

The engine decodes each token among whatever else is in flight (continuous batching, calls joining
mid-decode, shared prompts, K/V kept across turns); the trainer recomputes it in a packed
micro-batch. Through :mod:`postrl.models.invariant` both compute every token the same way, so the
comparison is ``==``, in float32 and bf16. Without exact mode the same comparisons differ (the
last tests pin that the default paths are *not* exact, so these tests fail on the old code)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from postrl.models import invariant, invariant_attention
from postrl.rollout.native.engine import NativeRolloutWorker
from postrl.train.exact_forward import ExactForward, RoundedWeights, exact_layout
from postrl.train.logprobs import plan_forward, token_logprobs
from postrl.types import Prompt, SamplingParams
from tests.conftest import make_tiny_model

SAMPLED = SamplingParams(n=3, temperature=1.0, max_tokens=70)  # 70: past the first key block of 64
DTYPES = [torch.float32, torch.bfloat16]


def _autocast(dtype: torch.dtype):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)


def _rows(rollouts) -> tuple[torch.Tensor, list[tuple[int, int]], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded rows, spans, group ids, the response tokens and the engine's logprobs."""
    ids = [list(r.prompt_ids) + list(r.response_ids) for r in rollouts]
    width = max(map(len, ids))
    input_ids = torch.tensor([x + [0] * (width - len(x)) for x in ids])
    spans = [(len(r.prompt_ids), len(r.response_ids)) for r in rollouts]
    groups = torch.tensor([r.prompt_index for r in rollouts])
    targets = torch.tensor([t for r in rollouts for t in r.response_ids])
    engine = torch.tensor([lp for r in rollouts for lp in r.logprobs])
    return input_ids, spans, groups, targets, engine


def _masks(input_ids: torch.Tensor, spans: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' attention mask and the mask of the logprobs wanted (each response token's)."""
    attention = torch.zeros_like(input_ids)
    target = torch.zeros(input_ids.shape[0], input_ids.shape[1] - 1)
    for row, (p, n) in enumerate(spans):
        attention[row, : p + n] = 1
        target[row, p - 1 : p - 1 + n] = 1
    return attention, target


def _trainer_logprobs(model, rollouts, dtype, groups: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(the trainer's exact logprobs of the rollouts' response tokens, the engine's)."""
    input_ids, spans, group_ids, targets, engine = _rows(rollouts)
    layout = exact_layout(input_ids, spans, group_ids if groups else None)
    with _autocast(dtype), torch.no_grad():
        logp, _ = ExactForward(model).token_logprobs(layout, targets, 1.0, False)
    return logp, engine


def _prompts(tokenizer, texts: list[str], **kw) -> list[Prompt]:
    return [Prompt(text=t, prompt_ids=tokenizer(t)["input_ids"], **kw) for t in texts]


@pytest.fixture(params=["llama", "qwen2"])
def model(request, char_tokenizer):
    return make_tiny_model(request.param, char_tokenizer)


# -- the operations --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_each_row_gets_the_same_numbers_whatever_else_is_in_the_call(dtype):
    torch.manual_seed(0)
    x = torch.randn(150, 48)
    w, norm, head = (torch.randn(96, 48) * 0.2).to(dtype), torch.randn(48).to(dtype), torch.randn(40, 48).to(dtype)
    full = {
        "linear": invariant.linear(x, w),
        "rms_norm": invariant.rms_norm(x, norm, 1e-6),
        "silu_mul": invariant.silu_mul(x),
        "logits": invariant.logits(x, head),
    }
    for n, start in ((1, 7), (3, 100), (33, 5), (64, 80)):
        rows = slice(start, start + n)
        perm = torch.randperm(n)
        assert torch.equal(invariant.linear(x[rows][perm], w), full["linear"][rows][perm])
        assert torch.equal(invariant.rms_norm(x[rows], norm, 1e-6), full["rms_norm"][rows])
        assert torch.equal(invariant.silu_mul(x[rows]), full["silu_mul"][rows])
        assert torch.equal(invariant.logits(x[rows], head), full["logits"][rows])
    tokens = torch.randint(0, 40, (150,))
    lps = invariant.token_logprobs(full["logits"], tokens, 0.7)
    cos, sin = invariant.RotaryTable(torch.rand(8), 1.0)(torch.arange(150))
    turned = invariant.rotate(x.view(150, 3, 16).to(dtype), cos, sin)
    for rows in (slice(0, 1), slice(9, 10), slice(20, 53)):
        assert torch.equal(invariant.rotate(x.view(150, 3, 16)[rows].to(dtype), cos[rows], sin[rows]), turned[rows])
    assert torch.equal(invariant.token_logprobs(full["logits"][9:10], tokens[9:10], 0.7), lps[9:10])
    reference = torch.log_softmax(full["logits"].double() / 0.7, -1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(lps.double(), reference, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_and_products_of_wide_rows_split_across_threads_do_not_depend_on_the_row_count(dtype):
    """At a real model's widths the CPU splits a call's rows among threads (the norms are not
    padded to whole tiles): a row's norm is the same alone, in a decode step's 96 rows or in a
    training forward's 2,300; each tile's product, written into its rows of one output, is
    ``F.linear``'s of that tile, bias or not."""
    torch.manual_seed(2)
    x, norm = torch.randn(2300, 576) * 3, torch.randn(576).to(dtype)
    w, bias = (torch.randn(960, 576) * 0.05).to(dtype), torch.randn(960).to(dtype)
    full = invariant.rms_norm(x, norm, 1e-5)
    for start, n in ((0, 1), (7, 1), (100, 96), (5, 129), (0, 2300)):
        assert torch.equal(invariant.rms_norm(x[start : start + n], norm, 1e-5), full[start : start + n]), n
    if invariant.pack(w) is None:  # unpacked: the products written into one output
        h = full[:300]
        for b in (None, bias):
            out = invariant.linear(h, w, b)
            for tile in range(3):
                rows = slice(tile * invariant.TILE_ROWS, (tile + 1) * invariant.TILE_ROWS)
                assert torch.equal(out[rows], F.linear(invariant.pad_rows(h[rows]), w, b)[: out[rows].shape[0]])


@pytest.mark.parametrize("head_dim", [16, 64])
def test_attention_products_do_not_depend_on_their_rows_or_keys_count(head_dim):
    """What the attention's layout relies on, on this CPU's kernels: a decode step's items (one
    query: MIN_ITEM_ROWS rows) and a training forward's (16 queries) give a query the same scores
    and weighted values, and a score does not depend on how many keys share its product (the
    engine's cache length, the trainer's row width)."""
    torch.manual_seed(0)
    q, keys, probs, values = (
        torch.randn(30, 48, head_dim),
        torch.randn(30, 640, head_dim),
        torch.rand(30, 48, invariant_attention.KEY_BLOCK),
        torch.randn(30, invariant_attention.KEY_BLOCK, head_dim),
    )
    scores = torch.bmm(q, keys.transpose(1, 2))
    weighted = torch.bmm(probs, values)
    for rows in (invariant_attention.MIN_ITEM_ROWS, 8, 16, 33):
        for n_keys in (invariant_attention.KEY_BLOCK, 192, 640):
            part = torch.bmm(q[:, :rows].contiguous(), keys[:, :n_keys].transpose(1, 2))
            assert torch.equal(part, scores[:, :rows, :n_keys]), (rows, n_keys)
        assert torch.equal(torch.bmm(probs[:, :rows].contiguous(), values), weighted[:, :rows])


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_of_a_query_is_the_same_alone_and_among_longer_sequences(dtype):
    """Query (sequence s, position p) reads the same numbers whether the call holds one query or many
    and whether the store is 70 or 200 positions long; and it is causal softmax attention."""
    torch.manual_seed(1)
    heads, kv, d = 4, 2, 8
    keys, values = torch.randn(3, kv, 200, d).to(dtype), torch.randn(3, kv, 200, d).to(dtype)
    q = torch.randn(40, heads, d).to(dtype)
    seq, pos = torch.randint(0, 3, (40,)), torch.randint(0, 70, (40,))
    pos[0] = 150  # one query past the second block in the big call
    together = invariant_attention.attention(q, keys, values, invariant_attention.query_items(seq, pos))
    for t in (3, 17, 39):
        items = invariant_attention.query_items(seq[t : t + 1], pos[t : t + 1])
        alone = invariant_attention.attention(q[t : t + 1], keys[:, :, :70], values[:, :, :70], items)
        assert torch.equal(alone, together[t : t + 1])
    t = 5
    k = keys[seq[t], :, : pos[t] + 1].double().repeat_interleave(heads // kv, 0)
    v = values[seq[t], :, : pos[t] + 1].double().repeat_interleave(heads // kv, 0)
    probs = torch.softmax((q[t].double()[:, None] @ k.transpose(-1, -2)) * d**-0.5, -1)
    reference = (probs @ v).reshape(-1)
    torch.testing.assert_close(together[t].double(), reference, rtol=0, atol=1e-5 if dtype == torch.float32 else 2e-2)


def test_the_rotary_table_is_the_rotation_by_position():
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    table = invariant.RotaryTable(inv_freq, 1.0)
    cos, sin = table(torch.tensor([0, 300, 5]))
    assert cos.shape == (3, 1, 8) and table.cos.shape[0] == 2 * invariant.ROPE_CHUNK
    angle = 300 * inv_freq.double()
    torch.testing.assert_close(cos[1, 0].double(), torch.cat([angle.cos(), angle.cos()]), rtol=0, atol=1e-5)
    torch.testing.assert_close(sin[1, 0].double(), torch.cat([angle.sin(), angle.sin()]), rtol=0, atol=1e-5)
    assert torch.equal(table(torch.tensor([5]))[0], cos[2:3])  # a position's value does not move


# -- engine and trainer ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_sampled_groups_logprobs_equal_the_trainer_s_bit_for_bit(model, char_tokenizer, dtype):
    engine = NativeRolloutWorker.from_hf(model, char_tokenizer, dtype, exact=True)
    shared = "You are a careful calculator. Answer: "  # a prefix the engine prefills once for both prompts
    texts = ["12+7=", "what is 3*4?", "a", shared + "12+7=", shared + "9-4="]
    rollouts = engine.generate(_prompts(char_tokenizer, texts), SAMPLED, None)
    assert max(len(r.response_ids) for r in rollouts) > invariant_attention.KEY_BLOCK - 10
    trainer, reported = _trainer_logprobs(model, rollouts, dtype)
    assert trainer.numel() >= 200
    assert torch.equal(trainer, reported)
    # however the trainer packs them: each row alone, reversed, prompts not shared
    alone = torch.cat([_trainer_logprobs(model, [r], dtype)[0] for r in rollouts])
    assert torch.equal(alone, reported)
    assert torch.equal(_trainer_logprobs(model, rollouts[::-1], dtype, groups=False)[0], _rows(rollouts[::-1])[4])


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_gpu_s_fixed_batches_give_the_same_numbers(char_tokenizer, dtype, monkeypatch):
    """The path a GPU takes (row-wise work tile by tile, attention in padded batches of items), run
    here on the CPU: still exact, and the same numbers as the CPU's path."""
    model = make_tiny_model("llama", char_tokenizer)
    engine = NativeRolloutWorker.from_hf(model, char_tokenizer, dtype, exact=True)
    rollouts = engine.generate(_prompts(char_tokenizer, ["12+7=", "what is 3*4?"]), SAMPLED, None)
    monkeypatch.setattr(invariant, "fixed_batches", lambda device: True)
    trainer, reported = _trainer_logprobs(model, rollouts, dtype)
    assert torch.equal(trainer, reported)
    padded = NativeRolloutWorker.from_hf(model, char_tokenizer, dtype, exact=True)  # the engine's side too
    rollouts = padded.generate(_prompts(char_tokenizer, ["7*7=", "hello"]), SAMPLED, None)
    trainer, reported = _trainer_logprobs(model, rollouts, dtype)
    assert torch.equal(trainer, reported)


@pytest.mark.parametrize("dtype", DTYPES)
def test_requests_joining_mid_decode_keep_exact_logprobs(char_tokenizer, dtype):
    model = make_tiny_model("llama", char_tokenizer)
    engine = NativeRolloutWorker.from_hf(model, char_tokenizer, dtype, exact=True)
    joined: dict[str, list] = {}

    def join() -> None:
        joined["rollouts"] = engine.generate(_prompts(char_tokenizer, ["7*7=", "hello"]), SAMPLED, None)

    thread = threading.Thread(target=join)
    started: list[bool] = []

    def on_token(prompt_index, sample_index, token, logprob, top, finish) -> None:
        if not started:  # a second call while this one decodes: it joins between two steps
            started.append(True)
            thread.start()

    first = engine.generate(_prompts(char_tokenizer, ["12+7="]), SAMPLED, None, on_token=on_token)
    thread.join()
    both = first + joined["rollouts"]
    for rollouts in (first, joined["rollouts"]):
        trainer, reported = _trainer_logprobs(model, rollouts, dtype)
        assert torch.equal(trainer, reported)
    assert len(both) == 9


@pytest.mark.parametrize("dtype", DTYPES)
def test_kept_kv_across_turns_and_a_weight_update_between_them_stay_exact(char_tokenizer, dtype):
    """Turn 2 continues turn 1's kept K/V; then new weights arrive and turn 3 continues under them:
    every turn's logprobs equal the trainer's under the weights that sampled it."""
    model = make_tiny_model("llama", char_tokenizer)
    engine = NativeRolloutWorker.from_hf(model, char_tokenizer, dtype, exact=True, kv_after_update="recompute")
    one = SamplingParams(n=1, temperature=1.0, max_tokens=30)
    context = char_tokenizer("2+2=")["input_ids"]
    for turn in range(3):
        prefilled = engine.stats["prefill_tokens"]
        if turn == 2:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            engine.update_weights(dict(model.state_dict()), version=1)
        (rollout,) = engine.generate([Prompt("", context, cache_key="episode")], one, None)
        trainer, reported = _trainer_logprobs(model, [rollout], dtype)
        assert torch.equal(trainer, reported), f"turn {turn}"
        if turn == 1:  # it continued the kept K/V: only the tokens after them were prefilled
            assert engine.stats["prefill_tokens"] - prefilled < len(context) // 2
        context = context + list(rollout.response_ids) + char_tokenizer(" ok ")["input_ids"]


def test_the_trainer_s_plan_runs_the_exact_forward_and_its_gradient_flows(char_tokenizer):
    model = make_tiny_model("llama", char_tokenizer).train()
    engine = NativeRolloutWorker.from_hf(model, char_tokenizer, torch.float32, exact=True)
    rollouts = engine.generate(_prompts(char_tokenizer, ["1+1=", "3+4="]), SAMPLED, None)
    input_ids, spans, groups, _, reported = _rows(rollouts)
    attention, target = _masks(input_ids, spans)
    plan = plan_forward(model, input_ids, attention, target, groups, lean=False, exact=True)
    assert plan.path == "exact"
    logp, _ = token_logprobs(model, input_ids, attention, target_mask=target, group_ids=groups, plan=plan)
    assert torch.equal(logp[target.bool()], reported)
    logp.sum().backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0


def test_exact_values_and_gradients_match_the_transformers_model_in_float32(char_tokenizer):
    """The exact forward is the model: its logprobs, entropies and their gradients (the head's own
    backward included) equal the transformers forward's up to float32 rounding."""
    model = make_tiny_model("qwen2", char_tokenizer).train()  # qkv biases, an untied head
    engine = NativeRolloutWorker.from_hf(model, char_tokenizer, torch.float32, exact=True)
    rollouts = engine.generate(_prompts(char_tokenizer, ["1+1=", "3+4="]), SAMPLED, None)
    input_ids, spans, groups, _, _ = _rows(rollouts)
    attention, target = _masks(input_ids, spans)
    weights = torch.linspace(-1.0, 1.0, target.numel()).view_as(target)

    def run(exact: bool):
        model.zero_grad()
        plan = plan_forward(model, input_ids, attention, target, groups, lean=False, exact=exact)
        if not exact:
            plan = type(plan)("full", "reference")
        logp, entropy = token_logprobs(
            model, input_ids, attention, 0.8, "grad", target_mask=target, group_ids=groups, plan=plan
        )
        ((logp * weights + 0.3 * entropy * weights.flip(0)) * target).sum().backward()
        return logp * target, entropy * target, {n: p.grad.clone() for n, p in model.named_parameters()}

    exact, reference = run(True), run(False)
    torch.testing.assert_close(exact[0], reference[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(exact[1], reference[1], rtol=1e-4, atol=1e-5)
    for name, grad in reference[2].items():
        torch.testing.assert_close(exact[2][name], grad, rtol=1e-3, atol=1e-5, msg=name)


def test_bf16_exact_gradients_follow_the_float32_model(char_tokenizer):
    """In bf16 at T = 1 the exact head keeps its probabilities for the backward (the lean head's
    way); every parameter's gradient still points where the float32 model's does."""
    model = make_tiny_model("llama", char_tokenizer).train()
    engine = NativeRolloutWorker.from_hf(model, char_tokenizer, torch.bfloat16, exact=True)
    rollouts = engine.generate(_prompts(char_tokenizer, ["1+1=", "3+4="]), SAMPLED, None)
    input_ids, spans, groups, _, reported = _rows(rollouts)
    attention, target = _masks(input_ids, spans)
    weights = torch.linspace(-1.0, 1.0, target.numel()).view_as(target)

    def grads(exact: bool) -> dict[str, torch.Tensor]:
        model.zero_grad()
        plan = plan_forward(model, input_ids, attention, target, groups, lean=False, exact=exact)
        with _autocast(torch.bfloat16 if exact else torch.float32):
            logp, _ = token_logprobs(model, input_ids, attention, target_mask=target, group_ids=groups, plan=plan)
        if exact:
            assert torch.equal(logp[target.bool()], reported)
        (logp * weights * target).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    exact, reference = grads(True), grads(False)
    for name, grad in reference.items():
        assert exact[name].dtype == torch.float32
        cosine = F.cosine_similarity(exact[name].flatten(), grad.flatten(), dim=0)
        assert cosine > 0.99, (name, float(cosine))


def test_rounded_weights_are_kept_until_the_weights_change():
    """The fused, rounded copies are made once per weights version (an optimizer step, whose fused
    AdamW does not bump a tensor's version, or a load), and again when a parameter's version moves;
    the gradient reaches each parameter in its own dtype."""
    a, b = torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(2, 4))
    kept = RoundedWeights()
    first, _ = kept.get("ab", (a, b), torch.bfloat16)
    assert torch.equal(first, torch.cat([a, b]).detach().bfloat16())
    again, _ = kept.get("ab", (a, b), torch.bfloat16)
    assert again.data_ptr() == first.data_ptr()  # the same copy, not made again
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    torch.optim.AdamW([a, b], lr=0.5, fused=True).step()  # in place, the versions unchanged
    stale, _ = kept.get("ab", (a, b), torch.bfloat16)
    assert stale.data_ptr() == first.data_ptr()  # nothing told it
    kept.at(1)
    fresh, _ = kept.get("ab", (a, b), torch.bfloat16)
    assert torch.equal(fresh, torch.cat([a, b]).detach().bfloat16())
    with torch.no_grad():
        b.add_(1.0)  # a version bump
    assert torch.equal(kept.get("ab", (a, b), torch.bfloat16)[0], torch.cat([a, b]).detach().bfloat16())
    a.grad = b.grad = None
    weight, _ = kept.get("ab", (a, b), torch.bfloat16)
    (weight.float() * torch.arange(20.0).view(5, 4)).sum().backward()
    assert a.grad.dtype == torch.float32 and torch.equal(a.grad, torch.arange(12.0).view(3, 4))
    assert torch.equal(b.grad, torch.arange(12.0, 20.0).view(2, 4))


def test_the_exact_plan_refuses_what_it_cannot_compute(char_tokenizer):
    model = make_tiny_model("llama", char_tokenizer)
    ids = torch.tensor([[1, 2, 3, 4]])
    with pytest.raises(ValueError, match="prompt \\+ one contiguous response"):
        plan_forward(model, ids, torch.ones_like(ids), torch.tensor([[0.0, 1.0, 0.0]]) * 0, None, False, exact=True)
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="train.forward=exact"):
        plan_forward(gpt2, ids, torch.ones_like(ids), torch.tensor([[0.0, 1.0, 1.0]]), None, False, exact=True)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.exact=true", "rollout.backend=hf"], "needs the native engine"),
        (["rollout.exact=true", "rollout.dtype=bfloat16", "train.precision=float32"], "one dtype"),
        (["rollout.exact=true", "train.forward=transformers"], "train.forward=transformers does not apply"),
        (["train.forward=exact"], "'lean' or 'transformers'"),  # rollout.exact is the one switch
    ],
)
def test_exact_config_errors_name_the_fields(overrides, message):
    from postrl.run.demo import demo_config

    with pytest.raises(ValueError, match=message):
        demo_config(overrides)


def test_exact_numerics_are_resolved_once_and_reach_the_trainer():
    """Issue 59: rollout.exact is the only switch; the run's Numerics carry it to the trainer, which
    then computes the policy's logprobs with the exact forward. Dtypes that resolve apart on the
    machine are refused, naming both."""
    from postrl.models.numerics import Machine, resolve_numerics
    from postrl.run.demo import demo_config
    from postrl.train.factory import PolicySpec, build_train_worker

    config = demo_config(["rollout.exact=true", "rollout.dtype=float32", "train.precision=float32"])
    assert config.train.forward == "lean"  # nothing writes into the user's train section
    cpu = Machine(engine_bf16_fast=False, trainer_bf16=False, gpu=False)
    numerics = resolve_numerics(config, cpu)
    assert (numerics.engine, numerics.trainer, numerics.autocast, numerics.exact) == ("float32", "float32", False, True)
    assert numerics.describe() == "engine float32, trainer float32, exact, the engine's logprobs as the old policy's"
    trainer = build_train_worker(PolicySpec.of_run(config, numerics), torch.device("cpu"))
    assert trainer.exact
    plain = build_train_worker(PolicySpec.of_run(demo_config([]), resolve_numerics(demo_config([]), cpu)), "cpu")
    assert not plain.exact
    auto_engine = demo_config(["rollout.exact=true", "rollout.dtype=auto", "train.precision=float32"])
    assert resolve_numerics(auto_engine, cpu).engine == "float32"
    amx = Machine(engine_bf16_fast=True, trainer_bf16=False, gpu=False)  # auto: a bf16 engine there
    with pytest.raises(ValueError, match="bfloat16 and float32 on this machine"):
        resolve_numerics(auto_engine, amx)
    with pytest.raises(ValueError, match="float32 and bfloat16 on this machine"):
        demo_config(["rollout.exact=true", "rollout.dtype=float32", "train.precision=bf16_autocast"])


# -- a whole run -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("dtype", "precision"), [("float32", "float32"), ("bfloat16", "bf16_autocast")])
def test_an_exact_agent_run_is_on_policy_to_the_bit_and_repeats_itself(tmp_path, dtype, precision):
    """``postrl train`` with individually scheduled two-turn episodes answering after random delays:
    the engine-trainer logprob gap is 0.0 at every step (a weight sync between them), the importance
    weights are exactly 1, and a second run, on 2 threads where the first ran on 1, gives identical
    metrics, not merely close ones (without exact mode they agree to about 1e-3)."""
    from postrl.cli import main
    from tests.test_third_day import agent_run

    timing = ("time/", "throughput/", "perf/", "_s", "memory/")
    runs = []
    before = torch.get_num_threads()
    for name, threads in (("a", 1), ("b", 2)):
        torch.set_num_threads(threads)
        args = agent_run(
            tmp_path,
            f"name={name}",
            "steps=2",
            "agent.env=tests.fault_envs:JitteryGuess",
            "agent.max_context=120",
            "rollout.temperature=1.0",
            "rollout.exact=true",
            f"rollout.dtype={dtype}",
            f"train.precision={precision}",
            "algorithm.old_logprobs=recompute",
        )
        try:
            assert main(args) == 0
        finally:
            torch.set_num_threads(before)
        lines = (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()
        runs.append([{k: v for k, v in json.loads(line).items() if not any(t in k for t in timing)} for line in lines])
    for metrics in runs[0]:
        assert metrics["rollout/logprob_diff_max"] == 0.0
        assert metrics["rollout/mismatch_kl"] == 0.0
        assert metrics["rollout/is_weight_max"] == 1.0 and metrics["rollout/is_weight_mean"] == 1.0
    assert runs[0] == runs[1]


# -- the default paths are not exact ----------------------------------------------------------------
def test_without_exact_mode_bf16_logprobs_differ_from_the_trainer_s(char_tokenizer):
    """The comparison above, with the default engine and the lean forward: not equal (what exact
    mode fixes)."""
    model = make_tiny_model("llama", char_tokenizer)
    engine = NativeRolloutWorker.from_hf(model, char_tokenizer, torch.bfloat16)
    rollouts = engine.generate(_prompts(char_tokenizer, ["12+7=", "what is 3*4?"]), SAMPLED, None)
    input_ids, spans, groups, targets, reported = _rows(rollouts)
    attention, target = _masks(input_ids, spans)
    with _autocast(torch.bfloat16), torch.no_grad():
        logp, _ = token_logprobs(model, input_ids, attention, target_mask=target, group_ids=groups)
    assert not torch.equal(logp[target.bool()], reported)
    assert float((logp[target.bool()] - reported).abs().max()) > 1e-3


def test_the_exact_layer_is_written_once_for_the_engine_and_the_trainer():
    """Issue 59: the engine's and the trainer's exact forwards run one decoder layer
    (``models/exact_layer.decoder_layer``): no second copy of its operations to keep in step. The
    engine's exact attention is one closure, and the engine reads ``exact`` once: to choose its
    kernels."""
    import inspect
    import io
    import tokenize

    from postrl.models import exact_layer
    from postrl.rollout.native import exact_kernels
    from postrl.train import exact_forward

    src = Path(exact_layer.__file__).parents[1]

    def files_with(*needles: str) -> list[str]:
        return sorted(
            str(p.relative_to(src))
            for p in src.rglob("*.py")
            if p.name != "invariant.py" and any(n in p.read_text() for n in needles)
        )

    assert files_with("invariant.silu_mul(", "invariant.rotate(") == ["models/exact_layer.py"]
    assert "decoder_layer(" in inspect.getsource(exact_kernels.ExactKernels.forward)
    assert "decoder_layer(" in inspect.getsource(exact_forward.ExactForward._layer)
    assert files_with("invariant_attention.attention(") == ["rollout/native/exact_kernels.py", "train/exact_forward.py"]
    assert inspect.getsource(exact_kernels).count("invariant_attention.attention(") == 1

    def names(path: Path) -> list[str]:  # the code's names: no comments, no strings
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        return [t.string for t in tokens if t.type == tokenize.NAME]

    readers = {p.name for p in (src / "rollout" / "native").glob("*.py") if "exact" in names(p)}
    assert readers == {"engine.py", "model.py"}  # passed down to NativeCausalLM, which chooses its kernels
