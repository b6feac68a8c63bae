"""The native engine's weights for the Llama / Qwen2 / Mistral family.

Weights are held fused (q|k|v in one matrix, gate|up in another) so that a decode step is a
handful of large matrix products per layer. Every Hugging Face parameter name maps to a *view*
into those fused buffers, so a weight update copies in place: no rebuild, no reallocation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

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


class NativeWeights:
    """The fused buffers, the Hugging Face names that view them, and the LoRA adapters."""

    def __init__(
        self,
        cfg: NativeConfig,
        inv_freq: torch.Tensor,
        attention_scaling: float,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
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

    def write(self, state: dict[str, torch.Tensor], strict: bool) -> list[str]:
        """Copy Hugging Face-named base weights into place (all of them when ``strict``); returns
        the names written. Nothing is written when one does not fit."""
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
        return written
