"""The native engine's fast kernels: the projections on oneDNN-packed weights where the CPU packs
bf16 (what ``torch.compile``'s freezing does, ~1.5x faster than ``F.linear`` re-packing them on
every call), LoRA adapters unmerged, decode attention as masked batched matmuls over the cache's
contiguous blocks, prefill through SDPA."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from postrl.models import invariant
from postrl.rollout.native.kernels import LayerAttend, PrefillLayout
from postrl.rollout.native.kv_cache import KVCache

if TYPE_CHECKING:
    from postrl.rollout.native.weights import NativeWeights

SPAN_STEP = 64  # decode attends over positions [0, span): the longest active, rounded up to this


def _can_prepack(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN's bf16 weight packing, on a CPU that does it (:func:`postrl.models.invariant.cpu_packs_bf16`)."""
    return dtype == torch.bfloat16 and device.type == "cpu" and invariant.cpu_packs_bf16()


class FastKernels:
    """The fastest kernels for the engine's dtype and device."""

    def __init__(self, model: NativeWeights) -> None:
        self.model = model
        self.prepacked = _can_prepack(model.dtype, model.device)
        self.p_wqkv: list[torch.Tensor] = []
        self.p_wo: list[torch.Tensor] = []
        self.p_gate_up: list[torch.Tensor] = []
        self.p_down: list[torch.Tensor] = []
        self.p_head: torch.Tensor | None = None
        # unpacked, the output projection as [hidden, vocab]: a plain matmul on it is ~1.7x faster
        # on CPU than F.linear on [vocab, hidden]
        self.lm_head_t: torch.Tensor | None = None

    def prepare(self, head_written: bool) -> None:
        """The weights the projections multiply by: oneDNN-packed copies where the CPU prepacks, with
        each layer's stacked LoRA ``A`` appended below its fused projection's rows (one product
        gives ``x W^T`` and ``x A^T``, one of the adapters' two extra products per projection;
        measured ~3% faster per projection at 128 rows); elsewhere the fused buffers themselves.
        Run on every load, adapter syncs included (~0.1-0.2 s for SmolLM2 on 2 cores)."""
        m = self.model
        if not self.prepacked:
            self.p_wqkv, self.p_wo, self.p_gate_up, self.p_down = m.wqkv, m.wo, m.w_gate_up, m.w_down
            if head_written or self.lm_head_t is None:
                self.lm_head_t = m.lm_head.t().contiguous()
            return

        def pack(layer: int, group: str, w: torch.Tensor) -> torch.Tensor:
            fused = m.adapters.by_group.get((layer, group))
            if fused is not None:
                w = torch.cat([w, fused.a_t.t()])
            return torch.ops.mkldnn._reorder_linear_weight(w, 64)

        layers = range(m.cfg.layers)
        self.p_wqkv = [pack(i, "qkv", m.wqkv[i]) for i in layers]
        self.p_wo = [pack(i, "o", m.wo[i]) for i in layers]
        self.p_gate_up = [pack(i, "gate_up", m.w_gate_up[i]) for i in layers]
        self.p_down = [pack(i, "down", m.w_down[i]) for i in layers]
        self.p_head = torch.ops.mkldnn._reorder_linear_weight(m.lm_head, 64)

    def check_adapters(self, names: list[str]) -> None:
        """Any LoRA adapter is served, unmerged."""

    def _linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.prepacked:
            return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
        return F.linear(x, w, bias)

    def _project(
        self, layer: int, group: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x`` through fused projection ``group`` of ``layer``, its LoRA adapters added unmerged."""
        adapters = self.model.adapters
        fused = adapters.by_group.get((layer, group))
        if fused is None:
            return self._linear(x, w, bias)
        if not self.prepacked:
            return adapters.add(layer, group, x, self._linear(x, w, bias))
        rank = fused.a_t.shape[1]  # w holds [W; A]: the output's last `rank` columns are x A^T
        if bias is not None:
            bias = torch.cat([bias, bias.new_zeros(rank)])
        out = self._linear(x, w, bias)
        width = out.shape[-1] - rank
        return out[..., :width].addmm_(out[..., width:], fused.b_t)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.model
        freqs = positions.float().unsqueeze(-1) * m.inv_freq  # [T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * m.attention_scaling).to(m.dtype), (emb.sin() * m.attention_scaling).to(m.dtype)

    @staticmethod
    def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        write_slots: torch.Tensor,
        attend: LayerAttend,
        logits_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        m = self.model
        cfg = m.cfg
        d, nh, nkv = cfg.head_dim, cfg.heads, cfg.kv_heads
        rms = lambda x, w: F.rms_norm(x, (x.shape[-1],), w, cfg.eps)  # noqa: E731 (fp32 accumulation for bf16)
        x = F.embedding(tokens, m.embed)
        cos, sin = self._rope(positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for i in range(cfg.layers):
            h = rms(x, m.ln1[i])
            qkv = self._project(i, "qkv", h, self.p_wqkv[i], m.bqkv[i] if m.bqkv is not None else None)
            qk = self._apply_rope(qkv[:, : (nh + nkv) * d].view(-1, nh + nkv, d), cos, sin)
            q, k = qk[:, :nh], qk[:, nh:]
            v = qkv[:, (nh + nkv) * d :].view(-1, nkv, d)
            cache.write(i, write_slots, positions, k, v)
            attn = attend(i, q, k, v)  # [T, nh * d]
            x = x + self._project(i, "o", attn, self.p_wo[i])
            h = rms(x, m.ln2[i])
            gate, up = self._project(i, "gate_up", h, self.p_gate_up[i]).chunk(2, dim=-1)
            x = x + self._project(i, "down", F.silu(gate) * up, self.p_down[i])
        if logits_rows is not None:
            x = x[logits_rows]
        h = rms(x, m.final_norm)
        if self.p_head is not None:  # prepacked
            return self._linear(h, self.p_head).float()
        assert self.lm_head_t is not None
        return torch.matmul(h, self.lm_head_t).float()

    def cache_dtype(self) -> torch.dtype:
        return self.model.dtype

    def cache_length(self, length: int) -> int:
        return length

    def decode_attention(self, cache: KVCache, hi: int, attended: torch.Tensor) -> LayerAttend:
        cfg, device = self.model.cfg, attended.device
        # attend over the cache's contiguous blocks with an additive mask: on CPU, batched matmuls on
        # contiguous blocks beat both SDPA and gathers of the live part; each (slot, head) block of
        # positions [0, span) is contiguous, so the span costs no copy
        span = min(cache.max_len, -(-(int(attended.max()) + 1) // SPAN_STEP) * SPAN_STEP)
        keys = torch.arange(span, device=device)
        bias = torch.zeros((hi, 1, 1, span), dtype=torch.float32, device=device)
        bias.masked_fill_((keys.unsqueeze(0) > attended.unsqueeze(1)).view(hi, 1, 1, -1), float("-inf"))
        groups, scale = cfg.heads // cfg.kv_heads, cfg.head_dim**-0.5

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            qg = q.view(hi, cfg.kv_heads, groups, cfg.head_dim)
            cached_k, cached_v = cache.k[layer][:hi, :, :span], cache.v[layer][:hi, :, :span]
            scores = torch.add(bias, torch.matmul(qg, cached_k.transpose(-1, -2)), alpha=scale)
            probs = torch.softmax(scores, dim=-1).to(q.dtype)
            return torch.matmul(probs, cached_v).reshape(hi, cfg.heads * cfg.head_dim)

        return attend

    def prefill_attention(self, cache: KVCache, layout: PrefillLayout) -> LayerAttend:
        """Runs on a padded [items, longest, ...] view and reads keys from the cache, so a suffix
        attends to its cached prefix and, causally, to itself."""
        cfg, device = self.model.cfg, layout.first.device
        row, col, slots = layout.row, layout.col, layout.slots
        longest_q, longest_k = max(layout.lengths), int(layout.totals.max())
        key_pos = torch.arange(longest_k, device=device).view(1, 1, 1, -1)
        query_pos = layout.first.view(-1, 1, 1, 1) + torch.arange(longest_q, device=device).view(1, 1, -1, 1)
        mask = (key_pos <= query_pos) & (key_pos < layout.totals.view(-1, 1, 1, 1))
        items = len(layout.lengths)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            qp = q.new_zeros((items, longest_q, cfg.heads, cfg.head_dim))
            qp[row, col] = q
            keys = cache.k[layer][slots, :, :longest_k]
            values = cache.v[layer][slots, :, :longest_k]
            out = F.scaled_dot_product_attention(
                qp.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=cfg.kv_heads != cfg.heads
            )
            return out.transpose(1, 2)[row, col].reshape(-1, cfg.heads * cfg.head_dim)

        return attend

    def sequence_attention(self, cache: KVCache, length: int) -> LayerAttend:
        cfg = self.model.cfg

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys, values = cache.k[layer][:1, :, :length], cache.v[layer][:1, :, :length]
            out = F.scaled_dot_product_attention(
                q.unsqueeze(0).transpose(1, 2).to(keys.dtype),
                keys,
                values,
                is_causal=True,
                enable_gqa=cfg.kv_heads != cfg.heads,
            )
            return out.transpose(1, 2).reshape(length, cfg.heads * cfg.head_dim).to(q.dtype)

        return attend

    def sampled_logprobs(
        self, logits: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor, temperature: float
    ) -> torch.Tensor:
        return logprobs
