"""The lean Llama-family training forward against the transformers model: logprobs, entropy and
gradients in float32 (1e-5) and under bf16 autocast; its attention blocks by hand; the fallback."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from postrl.train import lean_forward
from postrl.train.lean_forward import block_layout, supports_lean_forward
from postrl.train.logprobs import token_logprobs
from tests.conftest import make_tiny_model
from tests.test_microbatch import grouped_batch


def test_block_layout_by_hand():
    layout = block_layout([([1, 2], [[3], [4, 5]])], torch.device("cpu"))
    assert layout.tokens.tolist() == [1, 2, 3, 4, 5]
    assert layout.positions.tolist() == [0, 1, 2, 2, 3]  # both responses continue the prompt
    pad = 5
    assert layout.query_index.tolist() == [[0, 1], [2, pad], [3, 4]]
    assert layout.key_index.tolist() == [[0, 1, pad, pad], [0, 1, 2, pad], [0, 1, 3, 4]]
    assert layout.query_slot.tolist() == [0, 1, 2, 4, 5]  # each token's row of the [3 x 2] queries
    t, f = True, False
    assert layout.allowed.tolist() == [
        [[t, f, f, f], [t, t, f, f]],  # the prompt: causal
        [[t, t, t, f], [t, f, f, f]],  # response 1 sees the prompt and itself; its padding row sees key 0
        [[t, t, t, f], [t, t, t, t]],  # response 2: the prompt, then causally its own tokens
    ]


def run(model, batch, lean: bool, group_ids=True, autocast=False, temperature=0.9):
    model = copy.deepcopy(model)
    model.set_attn_implementation("eager")
    model.train()
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with context:
        logp, entropy = token_logprobs(
            model,
            batch.input_ids,
            batch.attention_mask,
            temperature,
            with_entropy="grad",
            target_mask=batch.response_mask,
            group_ids=batch.group_ids if group_ids else None,
            lean=lean,
        )
    ((logp * batch.advantages).sum() + 0.1 * (entropy * batch.response_mask).sum()).backward()
    return logp.detach(), entropy.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # GQA; q/k/v biases
@pytest.mark.parametrize("group_ids", [True, False])
def test_lean_forward_equals_the_transformers_model_in_float32(char_tokenizer, kind, group_ids):
    batch = grouped_batch(char_tokenizer)
    model = make_tiny_model(kind, char_tokenizer)
    assert supports_lean_forward(model)
    (lp_hf, ent_hf, g_hf), (lp, ent, g) = (run(model, batch, lean, group_ids) for lean in (False, True))
    assert float((lp - lp_hf).abs().max()) < 1e-5
    assert float((ent - ent_hf).abs().max()) < 1e-5
    assert g.keys() == g_hf.keys()
    assert max(float((g[n] - g_hf[n]).abs().max()) for n in g) < 1e-5
    assert max(float(t.abs().max()) for t in g.values()) > 1.0
    assert float((lp * (1 - batch.response_mask)).abs().max()) == 0.0  # 0 outside the responses


def test_lean_forward_under_bf16_autocast_stays_near_the_transformers_model(char_tokenizer):
    batch = grouped_batch(char_tokenizer)
    model = make_tiny_model("llama", char_tokenizer)
    (lp_hf, _, g_hf), (lp, _, g) = (run(model, batch, lean, autocast=True) for lean in (False, True))
    assert float((lp - lp_hf).abs().max()) < 0.05  # bf16 matmuls, summed in other orders
    cosine = [torch.nn.functional.cosine_similarity(g[n].flatten(), g_hf[n].flatten(), dim=0) for n in g]
    assert min(float(c) for c in cosine) > 0.99


def test_activation_checkpointing_gives_the_same_gradients(char_tokenizer, monkeypatch):
    batch = grouped_batch(char_tokenizer)
    model = make_tiny_model("llama", char_tokenizer)
    plain = run(model, batch, lean=True)
    model.activation_checkpointing_enable()
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return checkpoint(*args, **kwargs)

    monkeypatch.setattr(lean_forward, "checkpoint", counted)
    checkpointed = run(model, batch, lean=True)
    assert len(calls) >= model.config.num_hidden_layers  # each layer is checkpointed
    assert torch.equal(plain[0], checkpointed[0])
    assert max(float((plain[2][n] - checkpointed[2][n]).abs().max()) for n in plain[2]) < 1e-6


def test_wrapped_projections_take_the_transformers_path(char_tokenizer):
    class Wrapped(torch.nn.Linear):
        """A stand-in for an adapter layer: the lean forward would not see what it adds."""

        def forward(self, x):
            return super().forward(x) * 2.0

    batch = grouped_batch(char_tokenizer)
    model = make_tiny_model("llama", char_tokenizer)
    q = model.model.layers[0].self_attn.q_proj
    wrapped = Wrapped(q.in_features, q.out_features, bias=False)
    wrapped.weight = q.weight
    model.model.layers[0].self_attn.q_proj = wrapped
    assert not supports_lean_forward(model)
    (lp_hf, _, _), (lp, _, _) = (run(model, batch, lean) for lean in (False, True))
    assert torch.equal(lp, lp_hf)


def test_rms_norm_silu_mul_and_half_softmax_match_autograd_of_the_plain_ops():
    from postrl.train.lean_forward import HalfSoftmax, RMSNorm, SiluMul

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 8, dtype=torch.float64, generator=gen), torch.randn(8, dtype=torch.float64, generator=gen)
    gate, up = (
        torch.randn(6, 8, generator=gen, dtype=torch.float64),
        torch.randn(6, 8, generator=gen, dtype=torch.float64),
    )
    scores = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64)
    cases = [
        (
            lambda a, b: RMSNorm.apply(a, b, 1e-6, a.dtype),
            lambda a, b: a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6) * b,
            (x, w),
        ),
        (SiluMul.apply, lambda a, b: torch.nn.functional.silu(a) * b, (gate, up)),
        (lambda a: HalfSoftmax.apply(a, a.dtype), lambda a: torch.softmax(a, -1), (scores,)),
    ]
    for ours, plain, inputs in cases:
        leaves = [t.clone().requires_grad_() for t in inputs]
        refs = [t.clone().requires_grad_() for t in inputs]
        out, ref = ours(*leaves), plain(*refs)
        weights = torch.randn(out.shape, generator=gen, dtype=torch.float64)
        (out * weights).sum().backward()
        (ref * weights).sum().backward()
        assert torch.allclose(out, ref, atol=1e-12)
        for a, b in zip(leaves, refs):
            assert torch.allclose(a.grad, b.grad, atol=1e-12)
            assert float(a.grad.abs().max()) > 0.01
    # bf16: SiluMul's gradients are bit-identical to autograd's through silu(gate) * up
    g16, u16 = gate.bfloat16().requires_grad_(), up.bfloat16().requires_grad_()
    g_ref, u_ref = gate.bfloat16().requires_grad_(), up.bfloat16().requires_grad_()
    SiluMul.apply(g16, u16).sum().backward()
    (torch.nn.functional.silu(g_ref) * u_ref).sum().backward()
    assert torch.equal(g16.grad, g_ref.grad) and torch.equal(u16.grad, u_ref.grad)


def test_lean_forward_under_bf16_keeps_no_float32_activation_for_the_backward(char_tokenizer):
    """What the backward keeps under bf16 autocast: no float32 [tokens, hidden] tensor (autograd
    through F.rms_norm keeps four per layer) and no float32 attention probabilities."""
    batch = grouped_batch(char_tokenizer)
    model = make_tiny_model("llama", char_tokenizer).train()
    tokens = None
    kept: list[tuple[tuple[int, ...], torch.dtype]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        token_logprobs(
            model,
            batch.input_ids,
            batch.attention_mask,
            target_mask=batch.response_mask,
            group_ids=batch.group_ids,
            lean=True,
        )
    hidden = model.config.hidden_size
    tokens = {shape[0] for shape, dtype in kept if dtype == torch.bfloat16 and len(shape) == 2 and shape[1] == hidden}
    assert tokens  # the layers' bf16 inputs are kept
    float_activations = [
        s for s, d in kept if d == torch.float32 and len(s) >= 2 and s[0] in tokens and s[-1] == hidden
    ]
    float_probs = [s for s, d in kept if d == torch.float32 and len(s) == 4]
    assert float_activations == [] and float_probs == []


def test_lean_forward_of_a_lora_model_equals_peft_s_forward(char_tokenizer):
    """Plain LoRA layers (B random, as after training): the lean forward's own base + B(s A x)
    against peft's forward through the transformers model, values and adapter gradients in float32;
    with the adapters disabled it is the base model."""
    from postrl.config.run import LoraConfig
    from postrl.train.lora import apply_lora, base_of

    batch = grouped_batch(char_tokenizer)
    base = make_tiny_model("llama", char_tokenizer)
    model = apply_lora(copy.deepcopy(base), LoraConfig(r=4, alpha=8.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    assert supports_lean_forward(base_of(model))
    (lp_hf, _, g_hf), (lp, _, g) = (run(model, batch, lean) for lean in (False, True))
    lora = [n for n in g if "lora_" in n and g[n] is not None]
    assert len(lora) == 2 * 7 * base.config.num_hidden_layers
    assert float((lp - lp_hf).abs().max()) < 1e-5
    # each adapter gradient within 1e-5 of its own scale (they reach ~16 here; float32 rounding of
    # the stacked q|k|v and gate|up products is ~3e-6 of it)
    assert max(float((g[n] - g_hf[n]).abs().max() / g_hf[n].abs().max()) for n in lora) < 1e-5
    assert min(float(g[n].abs().max()) for n in lora if "lora_A" in n) > 0  # B != 0: A gets a gradient
    lp_base, _, _ = run(base, batch, True)
    assert float((lp - lp_base).abs().max()) > 1e-3  # the adapters matter
    with model.disable_adapter():
        with torch.no_grad():
            lp_off, _ = token_logprobs(
                model,
                batch.input_ids,
                batch.attention_mask,
                0.9,
                target_mask=batch.response_mask,
                group_ids=batch.group_ids,
            )
    assert float((lp_off - lp_base).abs().max()) < 1e-5


def test_under_bf16_the_residual_stream_and_the_rotation_stay_float32(char_tokenizer, monkeypatch):
    """As in the transformers model under autocast: every norm reads a float32 residual stream and
    hands the projections bf16; q and k rotate in float32. A bf16 stream (the lean forward before
    issue 43) doubled the gradient's rounding error on SmolLM2 (docs/algorithms.md)."""
    from postrl.train import lean_forward

    seen: list[tuple[str, torch.dtype, torch.dtype]] = []
    norm, rope = lean_forward.RMSNorm.apply, lean_forward._rope

    def recorded_norm(x, weight, eps, out):
        seen.append(("norm", x.dtype, out))
        return norm(x, weight, eps, out)

    def recorded_rope(x, cos, sin):
        y = rope(x, cos, sin)
        seen.append(("rope", cos.dtype, y.dtype))
        return y

    monkeypatch.setattr(lean_forward.RMSNorm, "apply", recorded_norm)
    monkeypatch.setattr(lean_forward, "_rope", recorded_rope)
    batch = grouped_batch(char_tokenizer)
    model = make_tiny_model("llama", char_tokenizer).train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        token_logprobs(
            model,
            batch.input_ids,
            batch.attention_mask,
            target_mask=batch.response_mask,
            group_ids=batch.group_ids,
            lean=True,
        )
    layers = model.config.num_hidden_layers
    assert seen.count(("norm", torch.float32, torch.bfloat16)) == 2 * layers + 1
    assert seen.count(("rope", torch.float32, torch.float32)) == 2 * layers
    assert len(seen) == 4 * layers + 1
