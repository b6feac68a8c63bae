"""A lean inference-only forward for the Llama / Qwen2 / Mistral family.

Weights are held fused (q|k|v in one matrix, gate|up in another) so that a decode step is a
handful of large matrix products per layer. Every Hugging Face parameter name maps to a *view*
into those fused buffers, so a weight update copies in place: no rebuild, no reallocation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from postrl.models import invariant
from postrl.models.adapters import is_adapter_key
from postrl.models.exact_layer import LayerShape, LayerWeights, decoder_layer
from postrl.models.loading import PLAIN_HEAD_MODEL_TYPES
from postrl.rollout.native.adapters import EngineAdapters

SUPPORTED_MODEL_TYPES = PLAIN_HEAD_MODEL_TYPES


@dataclass(frozen=True)
class NativeConfig:
    model_type: str
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    qkv_bias: bool
    tied: bool

    @staticmethod
    def from_hf(config: Any) -> NativeConfig:
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type '{config.model_type}' is not one of {SUPPORTED_MODEL_TYPES}")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act '{config.hidden_act}' is not supported (silu only)")
        if getattr(config, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        qkv_bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        return NativeConfig(
            model_type=config.model_type,
            vocab_size=config.vocab_size,
            hidden=config.hidden_size,
            layers=config.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate=config.intermediate_size,
            eps=config.rms_norm_eps,
            qkv_bias=qkv_bias,
            tied=bool(getattr(config, "tie_word_embeddings", False)),
        )


def _can_prepack(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN's bf16 weight packing, on a CPU that does it (:func:`postrl.models.invariant.cpu_packs_bf16`)."""
    return dtype == torch.bfloat16 and device.type == "cpu" and invariant.cpu_packs_bf16()


class NativeCausalLM:
    """Fused weights + forward passes over a :class:`~postrl.rollout.native.kv_cache.KVCache`."""

    def __init__(
        self,
        cfg: NativeConfig,
        inv_freq: torch.Tensor,
        attention_scaling: float,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        exact: bool = False,
    ) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        # exact: every pass through the batch-invariant operations the trainer's exact forward
        # uses (postrl.models.invariant), on the plain weights (no packed copies, no LoRA)
        self.exact = exact
        h, d, L = cfg.hidden, cfg.head_dim, cfg.layers
        q_out, kv_out = cfg.heads * d, cfg.kv_heads * d
        new = lambda *shape: torch.empty(*shape, dtype=dtype, device=self.device)  # noqa: E731
        self.embed = new(cfg.vocab_size, h)
        self.lm_head = self.embed if cfg.tied else new(cfg.vocab_size, h)
        self.final_norm = new(h)
        self.wqkv = [new(q_out + 2 * kv_out, h) for _ in range(L)]
        self.bqkv = [new(q_out + 2 * kv_out) for _ in range(L)] if cfg.qkv_bias else None
        self.wo = [new(h, q_out) for _ in range(L)]
        self.w_gate_up = [new(2 * cfg.intermediate, h) for _ in range(L)]
        self.w_down = [new(h, cfg.intermediate) for _ in range(L)]
        self.ln1 = [new(h) for _ in range(L)]
        self.ln2 = [new(h) for _ in range(L)]
        self.inv_freq = inv_freq.float().to(self.device)
        self.attention_scaling = attention_scaling
        self.params = self._name_map(q_out, kv_out)
        self.adapters = EngineAdapters(L, h, q_out, kv_out, cfg.intermediate)  # LoRA, unmerged
        # On CPUs, bf16 projections run ~1.5x faster with weights reordered once into oneDNN's
        # blocked layout (what torch.compile's freezing does) than with F.linear re-packing them
        # on every call. The packed copies are refreshed by load().
        self.prepacked = not exact and _can_prepack(dtype, self.device)
        self.rotary = invariant.RotaryTable(self.inv_freq, attention_scaling)
        # unpacked, the output projection as [hidden, vocab]: a plain matmul on it is ~1.7x faster
        # on CPU than F.linear on [vocab, hidden]; refreshed from lm_head/embed by load()
        self.lm_head_t = None if self.prepacked or exact else new(h, cfg.vocab_size)

    # -- weights -------------------------------------------------------------------------------
    def _name_map(self, q_out: int, kv_out: int) -> dict[str, torch.Tensor]:
        """Hugging Face parameter name -> the view of our buffers it lives in."""
        inter = self.cfg.intermediate
        names: dict[str, torch.Tensor] = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.final_norm}
        if not self.cfg.tied:
            names["lm_head.weight"] = self.lm_head
        for i in range(self.cfg.layers):
            p = f"model.layers.{i}."
            names[p + "self_attn.q_proj.weight"] = self.wqkv[i][:q_out]
            names[p + "self_attn.k_proj.weight"] = self.wqkv[i][q_out : q_out + kv_out]
            names[p + "self_attn.v_proj.weight"] = self.wqkv[i][q_out + kv_out :]
            if self.bqkv is not None:
                names[p + "self_attn.q_proj.bias"] = self.bqkv[i][:q_out]
                names[p + "self_attn.k_proj.bias"] = self.bqkv[i][q_out : q_out + kv_out]
                names[p + "self_attn.v_proj.bias"] = self.bqkv[i][q_out + kv_out :]
            names[p + "self_attn.o_proj.weight"] = self.wo[i]
            names[p + "mlp.gate_proj.weight"] = self.w_gate_up[i][:inter]
            names[p + "mlp.up_proj.weight"] = self.w_gate_up[i][inter:]
            names[p + "mlp.down_proj.weight"] = self.w_down[i]
            names[p + "input_layernorm.weight"] = self.ln1[i]
            names[p + "post_attention_layernorm.weight"] = self.ln2[i]
        return names

    @torch.no_grad()
    def load(self, state: dict[str, torch.Tensor], strict: bool = True) -> list[str]:
        """Copy Hugging Face-named tensors into place; returns the names written. LoRA adapters
        (``*.lora_A``, ``*.lora_B``, ``*.lora_scale``) replace the engine's adapters; a state of
        adapters only leaves the base weights as they are."""
        adapters = {k: v for k, v in state.items() if is_adapter_key(k)}
        if adapters and self.exact:
            raise ValueError("rollout.exact does not support LoRA adapters (the exact forward has no adapter path)")
        if adapters:
            written = self.adapters.load(adapters, self.dtype, self.device)
            state = {k: v for k, v in state.items() if k not in adapters}
            if not state:
                self._pack()
                return written
        unknown = [k for k in state if k not in self.params and not (k == "lm_head.weight" and self.cfg.tied)]
        wrong = [
            f"{k} {tuple(v.shape)} != {tuple(self.params[k].shape)}"
            for k, v in state.items()
            if k in self.params and tuple(v.shape) != tuple(self.params[k].shape)
        ]
        missing = [k for k in self.params if k not in state] if strict else []
        if unknown or wrong or missing:
            raise RuntimeError(
                f"weights do not fit the engine: unknown {unknown[:5]}, wrong shape {wrong[:5]}, missing {missing[:5]}"
            )
        written = []
        for name, tensor in state.items():
            if name in self.params:
                self.params[name].copy_(tensor)
                written.append(name)
        head = "model.embed_tokens.weight" if self.cfg.tied else "lm_head.weight"
        if head in written and self.lm_head_t is not None:
            self.lm_head_t.copy_(self.lm_head.t())
        self._pack()
        return written

    def _pack(self) -> None:
        """The weights the projections multiply by: oneDNN-packed copies where the CPU prepacks, with
        each layer's stacked LoRA ``A`` appended below its fused projection's rows (one product
        gives ``x W^T`` and ``x A^T``, one of the adapters' two extra products per projection;
        measured ~3% faster per projection at 128 rows); elsewhere the fused buffers themselves.
        Run on every load, adapter syncs included (~0.1-0.2 s for SmolLM2 on 2 cores)."""
        if self.exact:  # packed (or None) exactly as invariant.linear packs the trainer's weights
            layers = range(self.cfg.layers)
            self.x_wqkv = [invariant.pack(self.wqkv[i]) for i in layers]
            self.x_wo = [invariant.pack(self.wo[i]) for i in layers]
            self.x_gate_up = [invariant.pack(self.w_gate_up[i]) for i in layers]
            self.x_down = [invariant.pack(self.w_down[i]) for i in layers]
            self.x_head = invariant.pack(self.lm_head)
        if not self.prepacked:
            self.p_wqkv = self.wqkv
            self.p_wo = self.wo
            self.p_gate_up = self.w_gate_up
            self.p_down = self.w_down
            self.p_head = None
            return

        def pack(layer: int, group: str, w: torch.Tensor) -> torch.Tensor:
            fused = self.adapters.by_group.get((layer, group))
            if fused is not None:
                w = torch.cat([w, fused.a_t.t()])
            return torch.ops.mkldnn._reorder_linear_weight(w, 64)

        layers = range(self.cfg.layers)
        self.p_wqkv = [pack(i, "qkv", self.wqkv[i]) for i in layers]
        self.p_wo = [pack(i, "o", self.wo[i]) for i in layers]
        self.p_gate_up = [pack(i, "gate_up", self.w_gate_up[i]) for i in layers]
        self.p_down = [pack(i, "down", self.w_down[i]) for i in layers]
        self.p_head = torch.ops.mkldnn._reorder_linear_weight(self.lm_head, 64)

    @property
    def cache_dtype(self) -> torch.dtype:
        """The KV cache's dtype: float32 when exact (its attention reads K/V in float32: converted
        once, when written, instead of at every step), else the model's."""
        return torch.float32 if self.exact else self.dtype

    def _linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
        return F.linear(x, w, bias)

    def _project(
        self, layer: int, group: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x`` through fused projection ``group`` of ``layer``, its LoRA adapters added unmerged."""
        fused = self.adapters.by_group.get((layer, group))
        if fused is None:
            return self._linear(x, w, bias)
        if not self.prepacked:
            return self.adapters.add(layer, group, x, self._linear(x, w, bias))
        rank = fused.a_t.shape[1]  # w holds [W; A]: the output's last `rank` columns are x A^T
        if bias is not None:
            bias = torch.cat([bias, bias.new_zeros(rank)])
        out = self._linear(x, w, bias)
        width = out.shape[-1] - rank
        return out[..., :width].addmm_(out[..., width:], fused.b_t)

    @staticmethod
    def from_hf(
        model: torch.nn.Module, dtype: torch.dtype, device: torch.device | str = "cpu", exact: bool = False
    ) -> NativeCausalLM:
        cfg = NativeConfig.from_hf(model.config)
        rotary = model.model.rotary_emb
        scaling = float(getattr(rotary, "attention_scaling", 1.0))
        engine = NativeCausalLM(cfg, rotary.inv_freq, scaling, dtype, device, exact=exact)
        engine.load(dict(model.state_dict()))
        return engine

    # -- forward -------------------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """RMSNorm as one fused op (it accumulates in float32 for bf16 inputs)."""
        return F.rms_norm(x, (x.shape[-1],), w, self.cfg.eps)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq  # [T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.attention_scaling).to(self.dtype), (emb.sin() * self.attention_scaling).to(self.dtype)

    @staticmethod
    def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: Any,
        write_slots: torch.Tensor,
        attend: Any,
        logits_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One pass over a flat list of ``T`` tokens (packed prompts, or one token per decoding slot).

        ``write_slots[t]`` is the cache slot token ``t`` belongs to; its K/V go to
        ``cache[slot, :, positions[t]]``. ``attend(layer, q, k, v)`` computes attention for this
        layout (see the engine). Returns float32 logits for ``logits_rows`` (default: all rows).
        """
        if self.exact:
            return self._exact_forward(tokens, positions, cache, write_slots, attend, logits_rows)
        cfg = self.cfg
        d, nh, nkv = cfg.head_dim, cfg.heads, cfg.kv_heads
        x = F.embedding(tokens, self.embed)
        cos, sin = self._rope(positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for i in range(cfg.layers):
            h = self._rms(x, self.ln1[i])
            qkv = self._project(i, "qkv", h, self.p_wqkv[i], self.bqkv[i] if self.bqkv is not None else None)
            qk = self._apply_rope(qkv[:, : (nh + nkv) * d].view(-1, nh + nkv, d), cos, sin)
            q, k = qk[:, :nh], qk[:, nh:]
            v = qkv[:, (nh + nkv) * d :].view(-1, nkv, d)
            cache.write(i, write_slots, positions, k, v)
            attn = attend(i, q, k, v)  # [T, nh * d]
            x = x + self._project(i, "o", attn, self.p_wo[i])
            h = self._rms(x, self.ln2[i])
            gate, up = self._project(i, "gate_up", h, self.p_gate_up[i]).chunk(2, dim=-1)
            x = x + self._project(i, "down", F.silu(gate) * up, self.p_down[i])
        if logits_rows is not None:
            x = x[logits_rows]
        h = self._rms(x, self.final_norm)
        logits = self._linear(h, self.p_head) if self.prepacked else torch.matmul(h, self.lm_head_t)
        return logits.float()

    def _exact_forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: Any,
        write_slots: torch.Tensor,
        attend: Any,
        logits_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        """:meth:`forward` through :mod:`postrl.models.invariant`: the residual stream in float32,
        the projections in the engine's dtype, the same operations as
        :class:`postrl.train.exact_forward.ExactForward` (:func:`postrl.models.exact_layer.decoder_layer`;
        ``attend`` must be an exact attention too)."""
        cfg = self.cfg
        shape = LayerShape(cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.eps)
        x = F.embedding(tokens, self.embed).float()
        cos, sin = self.rotary(positions)
        for i in range(cfg.layers):

            def cached_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: int = i) -> torch.Tensor:
                cache.write(i, write_slots, positions, k, v)
                return attend(i, q, k, v)

            x = decoder_layer(x, self._exact_layer(i), shape, cos, sin, cached_attend)
        if logits_rows is not None:
            x = x[logits_rows]
        return invariant.logits(invariant.rms_norm(x, self.final_norm, cfg.eps), self.lm_head, self.x_head)

    def _exact_layer(self, i: int) -> LayerWeights:
        """Layer ``i``'s weights as exact mode computes with them (the ones held now, prepacked)."""
        return LayerWeights(
            self.ln1[i],
            self.wqkv[i],
            self.bqkv[i] if self.bqkv is not None else None,
            self.x_wqkv[i],
            self.wo[i],
            self.x_wo[i],
            self.ln2[i],
            self.w_gate_up[i],
            self.x_gate_up[i],
            self.w_down[i],
            self.x_down[i],
        )
