"""A model's architecture as the planner needs it, read from ``config.json`` alone (no weights)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from postrl.config.run import ConfigError


class ShapeError(ConfigError):
    """A ``config.json`` the planner cannot read; the message names the file and the field."""


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer (Llama, Qwen2, Mistral and their kin)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied_embeddings: bool
    qkv_bias: bool = False
    context: int | None = None
    model_type: str = "llama"
    source: str = ""

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_linear_params(self) -> int:
        """The projections of one decoder layer: q, k, v, o, gate, up, down (and q/k/v biases)."""
        attention = self.hidden * (2 * self.q_width + 2 * self.kv_width)
        bias = (self.q_width + 2 * self.kv_width) if self.qkv_bias else 0
        return attention + bias + 3 * self.hidden * self.intermediate

    @property
    def linear_params(self) -> int:
        """Parameters that run as matmuls in every token's forward: the layers' projections and the head."""
        return self.layers * self.layer_linear_params + self.vocab * self.hidden

    @property
    def params(self) -> int:
        embed = self.vocab * self.hidden
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        norms = (2 * self.layers + 1) * self.hidden
        return embed + head + norms + self.layers * self.layer_linear_params

    def kv_bytes_per_token(self, dtype_bytes: int, tensor_parallel: int = 1) -> int:
        """K and V of one token in every layer on one of ``tensor_parallel`` ranks (KV heads are split
        across ranks, and replicated when there are fewer heads than ranks)."""
        heads_per_rank = max(1, -(-self.kv_heads // tensor_parallel))
        return 2 * self.layers * heads_per_rank * self.head_dim * dtype_bytes


def _field(cfg: dict[str, Any], source: str, *names: str, default: Any = None) -> Any:
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    if default is not None:
        return default
    raise ShapeError(f"{source}: no {' or '.join(names)} (the planner needs it)")


def shape_from_config(cfg: dict[str, Any], source: str = "config.json") -> ModelShape:
    """The shape of a Hugging Face ``config.json`` (its ``text_config`` for a multimodal one)."""
    cfg = cfg.get("text_config", cfg)
    hidden = int(_field(cfg, source, "hidden_size", "n_embd", "d_model"))
    heads = int(_field(cfg, source, "num_attention_heads", "n_head"))
    model_type = cfg.get("model_type", "")
    return ModelShape(
        vocab=int(_field(cfg, source, "vocab_size")),
        hidden=hidden,
        layers=int(_field(cfg, source, "num_hidden_layers", "n_layer")),
        heads=heads,
        kv_heads=int(_field(cfg, source, "num_key_value_heads", default=heads)),
        head_dim=int(_field(cfg, source, "head_dim", default=hidden // heads)),
        intermediate=int(_field(cfg, source, "intermediate_size", "n_inner", default=4 * hidden)),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
        context=cfg.get("max_position_embeddings"),
        model_type=str(model_type or "unknown"),
        source=source,
    )


def load_shape(path: str) -> ModelShape:
    """``path``: a model folder (its ``config.json``), a ``config.json`` file, or a shipped model's name."""
    from postrl.models.loading import SHIPPED_MODELS

    file = SHIPPED_MODELS[path][0] / "config.json" if path in SHIPPED_MODELS else Path(path).expanduser()
    if file.is_dir():
        file = file / "config.json"
    if not file.is_file():
        raise ShapeError(
            f"no config.json at {path}: the planner reads a model folder or its config.json (no weights needed)"
        )
    try:
        cfg = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ShapeError(f"{file}: invalid JSON at line {exc.lineno} column {exc.colno}") from None
    if not isinstance(cfg, dict):
        raise ShapeError(f"{file}: expected a JSON object")
    return shape_from_config(cfg, str(file))
