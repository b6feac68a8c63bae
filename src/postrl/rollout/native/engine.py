"""postrl's native Rollout Worker: continuous batching over a static KV cache.

- A fixed set of decode slots. A finished sequence frees its slot at once and the next waiting
  prompt is admitted into it in the same iteration.
- Prefix sharing: a prompt is prefilled once; its K/V are copied into the slots of its other
  G-1 samples, which then sample independently.
- Prefill packs several prompts into one flat token list (no padding) with a block-diagonal
  causal mask.
- Every iteration samples all rows (decode and newly prefilled) in one call.
- bf16 on CPUs with AMX (or any dtype asked for), the same code on CUDA.
- In-flight weight updates: weights that arrive (from another thread) while a ``generate`` runs
  are swapped in between two decode iterations; the in-flight sequences continue from their
  prefix, whose KV cache is recomputed under the new weights (``kv_after_update="recompute"``) or
  kept (``"keep"``). Every token records the version of the weights that produced it and the oldest
  version in the cache it attended to.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from postrl.models.weights import WeightSyncError
from postrl.rollout.common import EngineBase, non_finite
from postrl.rollout.hf_engine import eos_ids
from postrl.rollout.native.kv_cache import MIN_SHARED_PREFIX, KeptCaches, KVCache, shared_prefix_length
from postrl.rollout.native.model import NativeCausalLM
from postrl.rollout.sampling import sample_tokens, top_logprobs
from postrl.rollout.stops import StopChecker
from postrl.types import Health, Prompt, Rollout, SamplingParams, TokenCallback, compact_versions

log = logging.getLogger(__name__)


@dataclass
class _Seq:
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the weights that produced each token
    kv_versions: list[int] = field(default_factory=list)  # the oldest weights behind the cache it attended to
    cache_key: str | None = None  # kept in KeptCaches under this key when it finishes


@dataclass
class _PendingWeights:
    state: dict[str, torch.Tensor]
    version: int
    manifest: dict[str, str] | None
    error: BaseException | None = None
    applied: bool = False


class NativeRolloutWorker(EngineBase):
    streams_tokens = True

    def __init__(
        self,
        model: NativeCausalLM,
        tokenizer: Any,
        eos: set[int],
        max_batch_size: int = 256,
        seed: int = 0,
        max_prefill_tokens: int = 2048,
        cache_reuse_ratio: float = 2.0,
        kv_after_update: str = "keep",
        kept_cache_mb: int = 1024,
        release_cache: bool = True,
    ) -> None:
        if kv_after_update not in ("recompute", "keep"):
            raise ValueError(f"kv_after_update must be 'recompute' or 'keep', got {kv_after_update!r}")
        self.kv_after_update = kv_after_update
        self._generation = threading.Lock()  # one scheduler run (generate, health check) at a time
        self._swap = threading.Condition()  # guards _generating and _pending
        self._generating = False
        self._suspending = False  # suspend() asked the scheduler run in progress to return
        self._pending: _PendingWeights | None = None
        self.updates_in_flight = 0  # weight updates applied in the middle of a generate
        self.model, self.tokenizer = model, tokenizer
        self.max_batch_size, self.max_prefill_tokens = max_batch_size, max_prefill_tokens
        self.cache_reuse_ratio, self.release_cache = cache_reuse_ratio, release_cache
        self.generator = torch.Generator(device=model.device).manual_seed(seed)
        self.weight_version = 0
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self._eos = eos
        self.cache: KVCache | None = None
        self.kept = KeptCaches(kept_cache_mb << 20)  # finished sequences' K/V by Prompt.cache_key
        self.stats = {"prefill_s": 0.0, "prefill_tokens": 0, "decode_s": 0.0, "decode_tokens": 0}

    @staticmethod
    def from_hf(
        model: torch.nn.Module, tokenizer: Any, dtype: torch.dtype = torch.float32, **kw: Any
    ) -> NativeRolloutWorker:
        device = next(model.parameters()).device
        return NativeRolloutWorker(
            NativeCausalLM.from_hf(model, dtype, device), tokenizer, eos_ids(model, tokenizer), **kw
        )

    # -- RolloutWorker interface -----------------------------------------------------------------
    def generate(
        self,
        prompts: list[Prompt],
        sampling_params: SamplingParams,
        weight_version: int | None,
        on_token: TokenCallback | None = None,
    ) -> list[Rollout]:
        """``on_token`` (optional) sees every token as it is sampled, for streaming."""
        if not prompts:
            self.check_version(weight_version)
            return []
        with self._generation, self._running():
            self.check_version(weight_version)
            self.seed(sampling_params.seed)
            slots = min(self.max_batch_size, len(prompts) * sampling_params.n)
            max_len = max(len(p.prompt_ids) for p in prompts) + sampling_params.max_tokens
            self._ensure_cache(slots, max_len)
            seqs = _Scheduler(self, prompts, sampling_params, slots, on_token).run()
            if self.release_cache:  # a trainer in this process or on this GPU gets the memory back
                self.cache = None
        return [self._rollout(s, finish, bool(sampling_params.top_logprobs)) for s, finish in seqs]

    def _rollout(self, s: _Seq, finish: str, with_top: bool) -> Rollout:
        oldest, own, cache = compact_versions(s.versions, s.kv_versions, self.weight_version)
        return Rollout(
            prompt_index=s.prompt_index,
            prompt_ids=list(s.prompt_ids),
            response_ids=s.tokens,
            logprobs=s.logprobs,
            text=self.tokenizer.decode(s.tokens, skip_special_tokens=True),
            finish_reason=finish,  # type: ignore[arg-type]
            weight_version=oldest,
            top_logprobs=s.top if with_top else None,
            logprob_versions=own,
            kv_versions=cache,
        )

    @contextlib.contextmanager
    def _running(self) -> Iterator[None]:
        """Marks a scheduler run: weights arriving meanwhile wait for :meth:`apply_pending_weights`."""
        with self._swap:
            self._generating, self._suspending = True, False
        try:
            yield
        finally:
            with self._swap:
                self._generating, self._suspending = False, False
                self.apply_pending_weights()

    def suspend(self) -> bool:
        """Ask the generate in progress (another thread's) to return before its next decode step:
        its unfinished samples come back ``suspended`` with the tokens sampled so far, those not yet
        admitted with none. True when a generate was running."""
        with self._swap:
            self._suspending = self._generating
            return self._suspending

    def update_weights(
        self, weights: dict[str, torch.Tensor] | str | Path, version: int, manifest: dict[str, str] | None = None
    ) -> None:
        """Copy new weights into the engine in place; with a manifest, verify what arrived. While a
        ``generate`` runs (in another thread) the weights are swapped in at its next decode
        iteration, and this call returns once they are."""
        state = self.verified_state(weights, manifest)
        with self._swap:
            if not self._generating:
                self._load(state, version, manifest)
                return
            pending = self._pending = _PendingWeights(state, version, manifest)
            self._swap.wait_for(lambda: pending.applied)
        if pending.error is not None:
            raise pending.error

    def apply_pending_weights(self) -> bool:
        """Swap in weights that arrived during a generate (call with ``_swap`` held, or from the
        generating thread); True when there were some."""
        with self._swap:
            pending, self._pending = self._pending, None
            if pending is None:
                return False
            try:
                self._load(pending.state, pending.version, pending.manifest)
            except BaseException as exc:  # handed to the caller of update_weights
                pending.error = exc
            pending.applied = True
            self._swap.notify_all()
            return pending.error is None

    def _load(self, state: dict[str, torch.Tensor], version: int, manifest: dict[str, str] | None) -> None:
        written = self.model.load(state, strict=True)
        if self.kv_after_update == "recompute":
            self.kept.clear()  # K/V kept from the old weights is not reused
        if manifest is not None:
            bad = [
                n
                for n in written
                if n in self.model.params and not torch.equal(self.model.params[n], state[n].to(self.model.dtype))
            ]
            if bad:
                raise WeightSyncError(f"engine weights differ from the sent weights after the copy: {bad[:5]}")
        self.weight_version = version

    def health_check(self) -> Health:
        """Finite weights, a KV cache that matches the model, and one greedy token generated through
        the real scheduler (into slot 0 of the existing cache, whose contents are scratch between calls)."""
        bad = non_finite(list(self.model.params.items()))
        if bad:
            return Health(False, f"non-finite weights in {bad[:3]}")
        cfg = self.model.cfg
        probe = Prompt(text="", prompt_ids=[self.pad_id])
        with self._generation, self._running():  # a generate in flight may release the cache
            if self.cache is None:
                self._ensure_cache(1, 2)
            assert self.cache is not None
            layers, kv_shape = len(self.cache.k), tuple(self.cache.k[0].shape)
            if layers != cfg.layers or kv_shape[1] != cfg.kv_heads or kv_shape[3] != cfg.head_dim:
                return Health(
                    False,
                    f"KV cache of {layers} layers x {kv_shape} does not match the model "
                    f"({cfg.layers} layers, {cfg.kv_heads} KV heads of {cfg.head_dim})",
                )
            seqs = _Scheduler(
                self, [probe], SamplingParams(n=1, temperature=0.0, max_tokens=1), 1, suspendable=False
            ).run()
        tokens, logprobs = seqs[0][0].tokens, seqs[0][0].logprobs
        if len(tokens) != 1 or not 0 <= tokens[0] < self.model.embed.shape[0] or not math.isfinite(logprobs[0]):
            return Health(False, f"generating one token gave {tokens} with logprobs {logprobs}")
        return Health(True)

    # -- internals -------------------------------------------------------------------------------
    def _ensure_cache(self, slots: int, max_len: int) -> None:
        """Reuse the cache across calls when it fits and is at most ``cache_reuse_ratio`` times too long
        (decode attends over its whole length); otherwise allocate it once for this call."""
        old = self.cache
        if old is not None and old.fits(slots, max_len) and old.max_len <= self.cache_reuse_ratio * max_len:
            return
        slots = max(slots, old.slots if old else 0)
        cfg = self.model.cfg
        self.cache = None
        self.cache = KVCache(
            cfg.layers, slots, cfg.kv_heads, max_len, cfg.head_dim, self.model.dtype, self.model.device
        )


class _Scheduler:
    """One ``generate`` call: admits prompts into free slots and decodes until all are done."""

    def __init__(
        self,
        engine: NativeRolloutWorker,
        prompts: list[Prompt],
        sp: SamplingParams,
        slots: int,
        on_token: TokenCallback | None = None,
        suspendable: bool = True,
    ) -> None:
        """``suspendable=False``: the run ignores :meth:`NativeRolloutWorker.suspend` (a health
        check's probe, which must finish)."""
        self.e, self.sp, self.n_slots, self.on_token = engine, sp, slots, on_token
        self.suspendable = suspendable
        self.cache = engine.cache
        self.device = engine.model.device
        self.waiting = deque((i, p.prompt_ids) for i, p in enumerate(prompts))
        self.keys = [p.cache_key for p in prompts]
        self.remaining = {i: sp.n for i in range(len(prompts))}
        self.free = list(range(slots))
        heapq.heapify(self.free)
        self.active: dict[int, _Seq] = {}
        self.pos = torch.zeros(slots, dtype=torch.long, device=self.device)  # next write position
        self.is_active = torch.zeros(slots, dtype=torch.bool, device=self.device)
        self.last = torch.zeros(slots, dtype=torch.long, device=self.device)  # last sampled token
        self.stop_ids = torch.tensor(sorted(engine._eos | set(sp.stop_token_ids)), dtype=torch.long, device=self.device)
        self.checker = StopChecker(engine.tokenizer, sp.stop)
        self.finished: list[tuple[_Seq, str]] = []
        self.kv_version = [engine.weight_version] * slots  # the oldest weights behind each slot's cache
        self.kept_versions: dict[int, int] = {}  # prompt index -> version of the K/V restored for it

    def run(self) -> list[tuple[_Seq, str]]:
        while self.waiting or self.active:
            if self.e._suspending and self.suspendable:
                self._suspend_all()
                break
            if self.e._pending is not None and self.e.apply_pending_weights():
                self._after_update()
            row_slots, logits = [], []
            if self.active:
                start = time.perf_counter()
                slots, lg = self._decode()
                self.e.stats["decode_s"] += time.perf_counter() - start
                self.e.stats["decode_tokens"] += len(slots)
                row_slots.append(slots)
                logits.append(lg)
            start = time.perf_counter()
            admitted = self._admit()
            self.e.stats["prefill_s"] += time.perf_counter() - start
            if admitted is not None:
                row_slots.append(admitted[0])
                logits.append(admitted[1])
            slots, rows = torch.cat(row_slots), torch.cat(logits)
            tokens, lps = sample_tokens(rows, self.sp.temperature, self.sp.top_k, self.sp.top_p, self.e.generator)
            top = top_logprobs(rows, self.sp.temperature, self.sp.top_logprobs) if self.sp.top_logprobs else None
            self._record(slots, tokens, lps, top)
        self.finished.sort(key=lambda t: (t[0].prompt_index, t[0].sample_index))
        return self.finished

    def _suspend_all(self) -> None:
        """Every unfinished sample is finished as ``suspended``: the active ones with their tokens
        (each sampled token's logprob is recorded; its K/V is not, a continuation prefills it), the
        samples not yet admitted with none."""
        for slot in sorted(self.active):
            self.finished.append((self.active.pop(slot), "suspended"))
            self.is_active[slot] = False
            heapq.heappush(self.free, slot)
        for i, ids in self.waiting:
            started = self.sp.n - self.remaining[i]
            self.finished += [(_Seq(i, k, ids), "suspended") for k in range(started, self.sp.n)]
            self.remaining[i] = 0
        self.waiting.clear()

    def _after_update(self) -> None:
        """New weights mid-generation: the in-flight sequences continue from their prefix. With
        ``kv_after_update=recompute`` the prefix's K/V (prompt and every token but the last, which
        the next decode feeds) is recomputed under the new weights."""
        self.e.updates_in_flight += 1
        if self.e.kv_after_update == "keep" or not self.active:
            return
        items = [(s, seq.prompt_ids + seq.tokens[:-1]) for s, seq in sorted(self.active.items())]
        self._prefill(items, start=0)
        for s, _ in items:
            self.kv_version[s] = self.e.weight_version

    # decode: one token for every active slot, over the dense range [0, hi)
    def _decode(self) -> tuple[torch.Tensor, torch.Tensor]:
        active = sorted(self.active)
        hi = active[-1] + 1
        live = self.is_active[:hi]
        positions = torch.where(live, self.pos[:hi], 0)  # free slots in range write a dummy at 0
        cfg = self.e.model.cfg
        # attend over the cache's whole (contiguous) length with an additive mask: on CPU, bf16
        # batched matmuls on contiguous blocks beat both SDPA and strided slices of the live part
        span = torch.arange(self.cache.max_len, device=self.device)
        bias = torch.zeros((hi, 1, 1, self.cache.max_len), dtype=torch.float32, device=self.device)
        bias.masked_fill_((span.unsqueeze(0) > positions.unsqueeze(1)).view(hi, 1, 1, -1), float("-inf"))
        groups, scale = cfg.heads // cfg.kv_heads, cfg.head_dim**-0.5

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            qg = q.view(hi, cfg.kv_heads, groups, cfg.head_dim)
            scores = torch.add(bias, torch.matmul(qg, self.cache.k[layer][:hi].transpose(-1, -2)), alpha=scale)
            probs = torch.softmax(scores, dim=-1).to(q.dtype)
            return torch.matmul(probs, self.cache.v[layer][:hi]).reshape(hi, cfg.heads * cfg.head_dim)

        logits = self.e.model.forward(
            self.last[:hi], positions, self.cache, torch.arange(hi, device=self.device), attend
        )
        self.pos[:hi] += live.long()
        active_t = torch.tensor(active, dtype=torch.long, device=self.device)
        return active_t, logits[active_t] if len(active) != hi else logits

    # admit waiting prompts into free slots: prefill, then prefix copy to each group's slots
    def _admit(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        groups: list[tuple[int, list[int], list[int]]] = []  # (prompt index, prompt ids, slots)
        budget = self.e.max_prefill_tokens
        while self.waiting and self.free:
            i, ids = self.waiting[0]
            if groups and len(ids) > budget:
                break
            take = min(self.remaining[i], len(self.free))
            slots = [heapq.heappop(self.free) for _ in range(take)]
            self.remaining[i] -= take
            if self.remaining[i] == 0:
                self.waiting.popleft()
            groups.append((i, ids, slots))
            budget -= len(ids)
        if not groups:
            return None
        starts = self._restore_kept(groups)
        shared = 0 if any(starts) else shared_prefix_length([ids for _, ids, _ in groups])
        if shared >= MIN_SHARED_PREFIX:  # e.g. a common system prompt: compute its K/V once
            first = groups[0][2][0]
            self._prefill([(first, groups[0][1][:shared])], start=0)
            others = torch.tensor([slots[0] for _, _, slots in groups[1:]], device=self.device)
            self.cache.copy_prefix(first, others, shared)
            starts = [shared] * len(groups)
        logits = self._prefill([(slots[0], ids) for _, ids, slots in groups], start=starts)
        row_slots, repeat = [], []
        for i, ids, slots in groups:
            if len(slots) > 1:  # the G samples of a prompt share its K/V
                self.cache.copy_prefix(slots[0], torch.tensor(slots[1:], device=self.device), len(ids))
            first = self._first_sample_index(i, len(slots))
            for k, s in enumerate(slots):
                key = self.keys[i] if self.keys[i] is None or self.sp.n == 1 else f"{self.keys[i]}#{first + k}"
                self.active[s] = _Seq(i, first + k, ids, cache_key=key)
                self.kv_version[s] = self.kept_versions.get(i, self.e.weight_version)
                self.pos[s] = len(ids)
                self.is_active[s] = True
            row_slots.extend(slots)
            repeat.append(len(slots))
        logits = logits.repeat_interleave(torch.tensor(repeat, device=self.device), dim=0)
        return torch.tensor(row_slots, dtype=torch.long, device=self.device), logits

    def _restore_kept(self, groups: list[tuple[int, list[int], list[int]]]) -> list[int]:
        """Each group's tokens already in its slot: the K/V a previous call kept for its
        ``cache_key`` (the last turn of its episode), put back; 0 where there is none."""
        starts = []
        for i, ids, slots in groups:
            kept = self.e.kept.take(self.keys[i], ids) if self.sp.n == 1 else None
            if kept is not None:
                self.cache.restore(slots[0], kept)
                self.kept_versions[i] = kept.version
            starts.append(0 if kept is None else len(kept.ids))
        return starts

    def _prefill(self, items: list[tuple[int, list[int]]], start: int | list[int]) -> torch.Tensor:
        """Run tokens ``ids[start:]`` of each (slot, ids) through the model, packed without padding;
        positions before ``start`` (one for all, or one per item) are already in the slot's cache.
        Returns each item's last logits.

        Attention runs on a padded [items, longest, ...] view and reads keys from the cache, so a
        suffix attends to its cached prefix and, causally, to itself."""
        starts = [start] * len(items) if isinstance(start, int) else start
        lengths = [len(ids) - st for (_, ids), st in zip(items, starts, strict=True)]
        tokens = torch.tensor(
            [t for (_, ids), st in zip(items, starts) for t in ids[st:]], dtype=torch.long, device=self.device
        )
        first = torch.tensor(starts, dtype=torch.long, device=self.device)
        col = torch.cat([torch.arange(n, device=self.device) for n in lengths])
        row = torch.cat([torch.full((n,), g, dtype=torch.long, device=self.device) for g, n in enumerate(lengths)])
        slots = torch.tensor([s for s, _ in items], dtype=torch.long, device=self.device)
        total = torch.tensor([len(ids) for _, ids in items], device=self.device)
        longest_q, longest_k = max(lengths), int(total.max())
        key_pos = torch.arange(longest_k, device=self.device).view(1, 1, 1, -1)
        query_pos = first.view(-1, 1, 1, 1) + torch.arange(longest_q, device=self.device).view(1, 1, -1, 1)
        mask = (key_pos <= query_pos) & (key_pos < total.view(-1, 1, 1, 1))
        cfg = self.e.model.cfg

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            qp = q.new_zeros((len(items), longest_q, cfg.heads, cfg.head_dim))
            qp[row, col] = q
            keys = self.cache.k[layer][slots, :, :longest_k]
            values = self.cache.v[layer][slots, :, :longest_k]
            out = F.scaled_dot_product_attention(
                qp.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=cfg.kv_heads != cfg.heads
            )
            return out.transpose(1, 2)[row, col].reshape(-1, cfg.heads * cfg.head_dim)

        ends = torch.tensor(lengths, device=self.device).cumsum(0) - 1
        logits = self.e.model.forward(tokens, first[row] + col, self.cache, slots[row], attend, logits_rows=ends)
        self.e.stats["prefill_tokens"] += len(tokens)
        return logits

    def _first_sample_index(self, prompt_index: int, now: int) -> int:
        """Sample indices already handed out for this prompt (before this admission of ``now`` more)."""
        return self.sp.n - self.remaining[prompt_index] - now

    def _record(
        self, slots: torch.Tensor, tokens: torch.Tensor, lps: torch.Tensor, top: list[list[tuple[int, float]]] | None
    ) -> None:
        self.last[slots] = tokens
        is_stop = torch.isin(tokens, self.stop_ids).tolist()
        for row, (s, tok, lp, stop) in enumerate(zip(slots.tolist(), tokens.tolist(), lps.tolist(), is_stop)):
            seq = self.active[s]
            seq.tokens.append(tok)
            seq.logprobs.append(lp)
            seq.versions.append(self.e.weight_version)
            seq.kv_versions.append(self.kv_version[s])
            if top is not None:
                seq.top.append(top[row])
            finish = None
            if stop or self.checker.hit(seq.tokens):
                finish = "stop"
            elif len(seq.tokens) >= self.sp.max_tokens:
                finish = "length"
            if self.on_token is not None:
                self.on_token(seq.prompt_index, seq.sample_index, tok, lp, top[row] if top else None, finish)
            if finish:
                self._finish(s, finish)

    def _finish(self, slot: int, reason: str) -> None:
        seq = self.active.pop(slot)
        if seq.cache_key is not None:  # its cache holds every token but the last sampled one
            length = int(self.pos[slot])
            ids = (seq.prompt_ids + seq.tokens)[:length]
            self.e.kept.keep(seq.cache_key, ids, self.cache, slot, self.kv_version[slot])
        self.finished.append((seq, reason))
        self.is_active[slot] = False
        heapq.heappush(self.free, slot)
