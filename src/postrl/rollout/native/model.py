"""The native engine's model: its weights (:mod:`postrl.rollout.native.weights`) and the kernels
that compute with them, chosen once (:mod:`postrl.rollout.native.kernels`)."""

from __future__ import annotations

from typing import Any

import torch

from postrl.models.adapters import is_adapter_key
from postrl.rollout.native.exact_kernels import ExactKernels
from postrl.rollout.native.fast_kernels import FastKernels
from postrl.rollout.native.kernels import Kernels, LayerAttend
from postrl.rollout.native.kv_cache import KVCache
from postrl.rollout.native.weights import NativeConfig, NativeWeights


class NativeCausalLM(NativeWeights):
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
        super().__init__(cfg, inv_freq, attention_scaling, dtype, device)
        # rollout.exact's one reading in the engine: every pass through the batch-invariant
        # operations the trainer's exact forward runs, on the plain weights; else the fastest here
        self.kernels: Kernels = ExactKernels(self) if exact else FastKernels(self)

    def held(self) -> list[object]:
        """Everything the model holds, its kernels' copies of the weights included (what the memory
        planner's measurement counts)."""
        return [*vars(self).values(), *vars(self.kernels).values()]

    @torch.no_grad()
    def load(self, state: dict[str, torch.Tensor], strict: bool = True) -> list[str]:
        """Copy Hugging Face-named tensors into place; returns the names written. LoRA adapters
        (``*.lora_A``, ``*.lora_B``, ``*.lora_scale``) replace the engine's adapters; a state of
        adapters only leaves the base weights as they are."""
        adapters = {k: v for k, v in state.items() if is_adapter_key(k)}
        self.kernels.check_adapters(list(adapters))
        written = self.adapters.load(adapters, self.dtype, self.device) if adapters else []
        base = {k: v for k, v in state.items() if k not in adapters}
        if adapters and not base:
            self.kernels.prepare(head_written=False)
            return written
        written = self.write(base, strict)
        head = "model.embed_tokens.weight" if self.cfg.tied else "lm_head.weight"
        self.kernels.prepare(head_written=head in written)
        return written

    @staticmethod
    def from_hf(
        model: torch.nn.Module, dtype: torch.dtype, device: torch.device | str = "cpu", exact: bool = False
    ) -> NativeCausalLM:
        cfg = NativeConfig.from_hf(model.config)
        inner: Any = model.model  # a transformers Llama-family model's decoder, reached by name
        rotary = inner.rotary_emb
        scaling = float(getattr(rotary, "attention_scaling", 1.0))
        engine = NativeCausalLM(cfg, rotary.inv_freq, scaling, dtype, device, exact=exact)
        engine.load(dict(model.state_dict()))
        return engine

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        write_slots: torch.Tensor,
        attend: LayerAttend,
        logits_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One pass over a flat list of ``T`` tokens (packed prompts, or one token per decoding slot).

        ``write_slots[t]`` is the cache slot token ``t`` belongs to; its K/V go to
        ``cache[slot, :, positions[t]]``. ``attend(layer, q, k, v)`` computes attention for this
        layout (one of the kernels' attentions). Returns float32 logits for ``logits_rows``
        (default: all rows).
        """
        return self.kernels.forward(tokens, positions, cache, write_slots, attend, logits_rows)

    def sequence_logprobs(self, ids: list[int]) -> list[float]:
        """``log p(ids[t] | ids[:t])`` for t = 1 .. len(ids) - 1, untempered, in float32 (the first
        token has no context: it gets none). What the server's ``echo`` with ``logprobs`` returns
        and a URL teacher reads: one prefill of the sequence through the engine's own kernels, into
        a cache of its own, with the logits of every position."""
        if len(ids) < 2:
            return []
        cfg, kernels = self.cfg, self.kernels
        cache = KVCache(
            cfg.layers,
            1,
            cfg.kv_heads,
            kernels.cache_length(len(ids)),
            cfg.head_dim,
            kernels.cache_dtype(),
            self.device,
        )
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.arange(len(ids), device=self.device)
        slots = torch.zeros(len(ids), dtype=torch.long, device=self.device)
        logits = self.forward(tokens, positions, cache, slots, kernels.sequence_attention(cache, len(ids)))
        logp = torch.log_softmax(logits[:-1].float(), dim=-1)
        return logp.gather(-1, tokens[1:].unsqueeze(-1)).squeeze(-1).cpu().tolist()
