"""The native engine's continuous batching: a loop admits prompts into free decode slots (a prompt
prefilled once, its K/V copied to the slots of its other samples), decodes all active slots in one
step, samples every row at once, and frees a slot the moment its sequence finishes; weights that
arrived meanwhile are applied between two steps (see :mod:`postrl.rollout.native.engine`).

The loop is open: ``generate`` calls made while it runs (other threads: episodes, server requests)
join it between two steps as :class:`Request` s, each with its own ``n``, ``max_tokens`` and
stops, and each answered the moment its last sample finishes, not when the loop ends. Calls join a
loop whose sampling they share (temperature, top-k, top-p, top-logprobs: all rows are sampled in one
call); the cache grows to take them."""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable

import torch

from postrl.rollout.native.kernels import PrefillLayout
from postrl.rollout.native.kv_cache import MIN_SHARED_PREFIX, KVCache, shared_prefix_length
from postrl.rollout.native.loop_state import LoopState
from postrl.rollout.native.sequences import ForwardPass, Request, SamplingKey, Sequence, sampling_key
from postrl.rollout.sampling import sample_tokens, top_logprobs
from postrl.rollout.stops import StopChecker
from postrl.rollout.streams import derive, prompt_key, uniforms

COMPACT_AT = 8  # idle slots below the highest active one that make decode move sequences down
LENGTH_STEP = 128  # a cache that must grow for a longer context grows to a multiple of this


class DecodeLoop:
    """Admits the requests' prompts into free slots and decodes until every sample is done, taking
    the requests that join meanwhile (:meth:`add`, from ``joiners``)."""

    def __init__(
        self,
        state: LoopState,
        first: Request,
        joiners: Callable[[SamplingKey], list[Request]] | None = None,
        suspendable: bool = True,
    ) -> None:
        """``first`` sets the sampling every joining request shares; ``joiners(key)`` hands over the
        calls made since the last step that can join (None: a closed loop). ``suspendable=False``:
        the run ignores a suspend (a health check's probe, which must finish). ``state``: the engine's,
        whose cache the loop grows."""
        self.s = state
        self.sp = first.sp
        self.joiners = joiners
        self.suspendable = suspendable
        self.key = sampling_key(first.sp)
        self.device = state.model.device
        self.kernels = state.model.kernels
        self.waiting: deque[tuple[int, list[int]]] = deque()  # (loop prompt index, ids)
        self.owner: list[tuple[Request, int]] = []  # loop prompt index -> (request, its index there)
        self.keys: list[str | None] = []
        self.streams: list[int] = []  # loop prompt index -> its random stream
        self.remaining: dict[int, int] = {}
        self.active: dict[int, Sequence] = {}
        self.free: list[int] = []
        self.n_slots = 0
        self.cache: KVCache  # the engine's, set by the first add
        self.pos = torch.zeros(0, dtype=torch.long, device=self.device)  # next write position
        self.is_active = torch.zeros(0, dtype=torch.bool, device=self.device)
        self.last = torch.zeros(0, dtype=torch.long, device=self.device)  # last sampled token
        self.kv_version: list[int] = []  # the oldest weights behind each slot's cache
        self.kept_versions: dict[int, int] = {}  # loop prompt index -> version of the K/V restored for it
        self.requests: list[Request] = []
        self.add(first)

    def add(self, request: Request) -> None:
        """Queue a request's prompts; the cache grows (more slots, longer rows) to take them."""
        request.stop_ids = self.s.eos | frozenset(request.sp.stop_token_ids)
        request.checker = StopChecker(self.s.tokenizer, request.sp.stop)
        self.requests.append(request)
        for i, p in enumerate(request.prompts):
            g = len(self.owner)
            self.owner.append((request, i))
            self.keys.append(p.cache_key)
            self.streams.append(prompt_key(p.stream, request.sp.seed, i, self.s.generator))
            self.remaining[g] = request.sp.n
            self.waiting.append((g, p.prompt_ids))
        wanted = sum(self.remaining[g] for g, _ in self.waiting) + len(self.active)
        longest = max(len(p.prompt_ids) for p in request.prompts) + request.sp.max_tokens
        self._grow(min(self.s.max_batch_size, wanted), longest)

    def _grow(self, slots: int, max_len: int) -> None:
        """At least ``slots`` slots of ``max_len`` positions: the engine's cache, reused when it fits,
        else replaced by a larger one holding the active slots' K/V (slots at least double, so a
        loop joined one request at a time copies its cache a logarithmic number of times)."""
        if self.n_slots == 0:  # as many slots as the last loop had: calls that come one by one join it
            self._take_slots(self.s.ensure_cache(max(slots, min(self.s.slots_hint, self.s.max_batch_size)), max_len))
            return
        if self.cache.fits(max(slots, self.n_slots), max_len):
            return
        slots = max(slots, self.n_slots if slots <= self.n_slots else min(2 * self.n_slots, self.s.max_batch_size))
        if max_len > self.cache.max_len:  # contexts grow turn by turn: grow in steps, not by each turn
            max_len = -(-max_len // LENGTH_STEP) * LENGTH_STEP
        bigger = self.cache.resized(max(slots, self.cache.slots), max(max_len, self.cache.max_len))
        self.s.cache = bigger
        self._take_slots(bigger)

    def _take_slots(self, cache: KVCache) -> None:
        """Use ``cache`` (its first ``n_slots`` rows keep this loop's K/V): the new rows are free."""
        old, self.cache = self.n_slots, cache
        self.n_slots = cache.slots
        for s in range(old, cache.slots):
            heapq.heappush(self.free, s)
        extra = cache.slots - old
        self.pos = torch.cat([self.pos, torch.zeros(extra, dtype=torch.long, device=self.device)])
        self.is_active = torch.cat([self.is_active, torch.zeros(extra, dtype=torch.bool, device=self.device)])
        self.last = torch.cat([self.last, torch.zeros(extra, dtype=torch.long, device=self.device)])
        self.kv_version += [self.s.weights.weight_version] * extra

    def run(self, until: Callable[[], bool] | None = None) -> bool:
        """Step until every request is answered (True), or until ``until()`` holds after a step
        (False: the loop has work left; run it again to go on)."""
        while self._take_joiners() or self.waiting or self.active:
            self._step()
            if until is not None and until() and (self.waiting or self.active):
                return False
        return True

    def _step(self) -> None:
        if self.s.suspending.is_set() and self.suspendable:
            self._suspend_all()
            return
        if self.s.weights.apply_pending_weights():
            self._after_update()
        decode = self._decode_pass() if self.active else None
        admission = self._admission()
        passes = [p for p in (decode, admission[1] if admission else None) if p is not None]
        start = time.perf_counter()
        outputs = self._forward(passes)  # decode and prefill in one pass of the model
        took = time.perf_counter() - start
        decoded = len(decode.tokens) if decode is not None else 0
        share = decoded / sum(len(p.tokens) for p in passes)
        self.s.stats["decode_s"] += took * share
        self.s.stats["prefill_s"] += took * (1 - share)
        row_slots, logits = [], []
        if decode is not None:
            assert decode.live is not None and decode.owners is not None
            self.pos[: len(decode.live)] += decode.live.long()
            self.s.stats["decode_tokens"] += len(decode.rows)
            row_slots.append(decode.owners)
            logits.append(outputs[0])
        if admission is not None:
            slots, lg = self._activate(admission[0], outputs[-1])
            row_slots.append(slots)
            logits.append(lg)
        slots, rows = torch.cat(row_slots), torch.cat(logits)
        sampled = [self.active[s] for s in slots.tolist()]
        u = uniforms(torch.tensor([q.stream for q in sampled]), torch.tensor([len(q.tokens) for q in sampled]))
        tokens, lps = sample_tokens(rows, self.sp.temperature, self.sp.top_k, self.sp.top_p, u)
        lps = self.kernels.sampled_logprobs(rows, tokens, lps, self.sp.temperature)
        top = top_logprobs(rows, self.sp.temperature, self.sp.top_logprobs) if self.sp.top_logprobs else None
        self._record(slots, tokens, lps, top)

    def _forward(self, passes: list[ForwardPass]) -> list[torch.Tensor]:
        """Run the passes' tokens through the model at once (their attention each its own way);
        each pass's logits rows."""
        if len(passes) == 1:
            p = passes[0]
            return [self.s.model.forward(p.tokens, p.positions, self.cache, p.slots, p.attend, logits_rows=p.rows)]
        offsets = [0]
        for p in passes:
            offsets.append(offsets[-1] + len(p.tokens))

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return torch.cat([p.attend(layer, q[a:b], k[a:b], v[a:b]) for p, a, b in zip(passes, offsets, offsets[1:])])

        rows = torch.cat([p.rows + a for p, a in zip(passes, offsets)])
        logits = self.s.model.forward(
            torch.cat([p.tokens for p in passes]),
            torch.cat([p.positions for p in passes]),
            self.cache,
            torch.cat([p.slots for p in passes]),
            attend,
            logits_rows=rows,
        )
        return list(logits.split([len(p.rows) for p in passes]))

    def _take_joiners(self) -> bool:
        """Add the calls that joined since the last step; True when there were some."""
        if self.joiners is None:
            return False
        joined = self.joiners(self.key)
        for request in joined:
            self.add(request)
        return bool(joined)

    def fail(self, exc: BaseException) -> None:
        """Every request still waiting for its samples gets ``exc`` (the loop cannot go on)."""
        for request in self.requests:
            request.fail(exc)

    def unanswered(self) -> Request | None:
        """The oldest request of the loop still waiting for its samples."""
        return next((r for r in self.requests if not r.done.done()), None)

    def _suspend_all(self) -> None:
        """Every unfinished sample is finished as ``suspended``: the active ones with their tokens
        (each sampled token's logprob is recorded; its K/V is not, a continuation prefills it), the
        samples not yet admitted with none."""
        self.s.suspending.clear()  # one suspend() ends what runs now, not the calls that join later
        for slot in sorted(self.active):
            seq = self.active.pop(slot)
            seq.request.finish(seq, "suspended")
            self.is_active[slot] = False
            heapq.heappush(self.free, slot)
        for g, ids in self.waiting:
            request, i = self.owner[g]
            started = request.sp.n - self.remaining[g]
            for k in range(started, request.sp.n):
                request.finish(Sequence(i, k, ids, request, derive(self.streams[g], k)), "suspended")
            self.remaining[g] = 0
        self.waiting.clear()

    def _after_update(self) -> None:
        """New weights mid-generation: the in-flight sequences continue from their prefix. With
        ``kv_after_update=recompute`` the prefix's K/V (prompt and every token but the last, which
        the next decode feeds) is recomputed under the new weights."""
        self.s.updates_in_flight += 1
        if self.s.kv_after_update == "keep" or not self.active:
            return
        items = [(s, seq.prompt_ids + seq.tokens[:-1]) for s, seq in sorted(self.active.items())]
        self._prefill(items, start=0)
        for s, _ in items:
            self.kv_version[s] = self.s.weights.weight_version

    # decode: one token for every active slot, over the dense range [0, hi)
    def _decode_pass(self) -> ForwardPass:
        """One token for every active slot, computed over the dense range of slots [0, hi) (idle
        slots in it write a dummy K/V at their last position, which no prompt reaches)."""
        self._compact()
        active = sorted(self.active)
        hi = active[-1] + 1
        live = self.is_active[:hi].clone()
        attended = torch.where(live, self.pos[:hi], 0)
        written = torch.where(live, self.pos[:hi], self.cache.max_len - 1)
        active_t = torch.tensor(active, dtype=torch.long, device=self.device)
        slots = torch.arange(hi, device=self.device)
        rows = active_t if len(active) != hi else slots
        attend = self.kernels.decode_attention(self.cache, hi, attended)
        return ForwardPass(self.last[:hi], written, slots, attend, rows, owners=active_t, live=live)

    def _compact(self) -> None:
        """Move the highest active sequences into the free slots below them when the dense range
        [0, hi) that decode computes holds ``COMPACT_AT`` or more idle slots (sequences that finish
        at different times, calls that join one by one, leave holes); a move copies the sequence's
        K/V, which costs less than computing an idle row at every step."""
        active = sorted(self.active)
        if not active or active[-1] + 1 - len(active) < COMPACT_AT:
            return
        holes = sorted(s for s in self.free if s < active[-1])
        moves: list[tuple[int, int]] = []
        while holes and active and holes[0] < active[-1]:
            moves.append((active.pop(), holes.pop(0)))
        src = torch.tensor([m[0] for m in moves], dtype=torch.long, device=self.device)
        dst = torch.tensor([m[1] for m in moves], dtype=torch.long, device=self.device)
        self.cache.move(src, dst, int(self.pos[src].max()))
        for name in ("pos", "last", "is_active"):
            values = getattr(self, name)
            values[dst] = values[src]
        self.is_active[src] = False
        for s, d in moves:
            self.active[d] = self.active.pop(s)
            self.kv_version[d] = self.kv_version[s]
        moved_to = {d for _, d in moves}
        self.free = [s for s in self.free if s not in moved_to] + [s for s, _ in moves]
        heapq.heapify(self.free)

    # admit waiting prompts into free slots: prefill, then prefix copy to each group's slots
    def _admission(self) -> tuple[list[tuple[int, list[int], list[int]]], ForwardPass] | None:
        """The waiting prompts that get free slots now, as (prompt index, ids, slots) groups, with
        the pass that prefills them (what a kept cache or a shared prefix already holds is not)."""
        groups: list[tuple[int, list[int], list[int]]] = []
        budget = self.s.max_prefill_tokens
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
        return groups, self._prefill_pass([(slots[0], ids) for _, ids, slots in groups], starts)

    def _activate(
        self, groups: list[tuple[int, list[int], list[int]]], logits: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefilled groups' sequences, active in their slots: their slots and first logits."""
        row_slots, repeat = [], []
        for i, ids, slots in groups:
            if len(slots) > 1:  # the G samples of a prompt share its K/V
                self.cache.copy_prefix(slots[0], torch.tensor(slots[1:], device=self.device), len(ids))
            request, local = self.owner[i]
            first = self._first_sample_index(i, len(slots))
            for k, s in enumerate(slots):
                key = self.keys[i] if self.keys[i] is None or request.sp.n == 1 else f"{self.keys[i]}#{first + k}"
                stream = derive(self.streams[i], first + k)
                self.active[s] = Sequence(local, first + k, ids, request, stream, cache_key=key)
                self.kv_version[s] = self.kept_versions.get(i, self.s.weights.weight_version)
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
            kept = self.s.kept.take(self.keys[i], ids) if self.owner[i][0].sp.n == 1 else None
            if kept is not None:
                self.cache.restore(slots[0], kept)
                self.kept_versions[i] = kept.version
            starts.append(0 if kept is None else len(kept.ids))
        return starts

    def _prefill(self, items: list[tuple[int, list[int]]], start: int | list[int]) -> torch.Tensor:
        """Run tokens ``ids[start:]`` of each (slot, ids) through the model; each item's last logits."""
        starts = [start] * len(items) if isinstance(start, int) else start
        return self._forward([self._prefill_pass(items, starts)])[0]

    def _prefill_pass(self, items: list[tuple[int, list[int]]], starts: list[int]) -> ForwardPass:
        """Tokens ``ids[start:]`` of each (slot, ids), packed without padding; positions before
        ``start`` are already in the slot's cache. Its rows: each item's last token.

        Attention reads keys from the cache, so a suffix attends to its cached prefix and,
        causally, to itself."""
        lengths = [len(ids) - st for (_, ids), st in zip(items, starts, strict=True)]
        tokens = torch.tensor(
            [t for (_, ids), st in zip(items, starts) for t in ids[st:]], dtype=torch.long, device=self.device
        )
        first = torch.tensor(starts, dtype=torch.long, device=self.device)
        col = torch.cat([torch.arange(n, device=self.device) for n in lengths])
        row = torch.cat([torch.full((n,), g, dtype=torch.long, device=self.device) for g, n in enumerate(lengths)])
        slots = torch.tensor([s for s, _ in items], dtype=torch.long, device=self.device)
        totals = torch.tensor([len(ids) for _, ids in items], device=self.device)
        layout = PrefillLayout(slots, row, col, first, lengths, totals)
        attend = self.kernels.prefill_attention(self.cache, layout)
        ends = torch.tensor(lengths, device=self.device).cumsum(0) - 1
        self.s.stats["prefill_tokens"] += len(tokens)
        return ForwardPass(tokens, layout.positions, slots[row], attend, ends)

    def _first_sample_index(self, prompt_index: int, now: int) -> int:
        """Sample indices already handed out for this prompt (before this admission of ``now`` more)."""
        return self.owner[prompt_index][0].sp.n - self.remaining[prompt_index] - now

    def _record(
        self, slots: torch.Tensor, tokens: torch.Tensor, lps: torch.Tensor, top: list[list[tuple[int, float]]] | None
    ) -> None:
        self.last[slots] = tokens
        for row, (s, tok, lp) in enumerate(zip(slots.tolist(), tokens.tolist(), lps.tolist())):
            seq = self.active[s]
            request = seq.request
            assert request.checker is not None
            seq.tokens.append(tok)
            seq.logprobs.append(lp)
            seq.versions.append(self.s.weights.weight_version)
            seq.kv_versions.append(self.kv_version[s])
            if top is not None:
                seq.top.append(top[row])
            finish = None
            if tok in request.stop_ids or request.checker.hit(seq.tokens):
                finish = "stop"
            elif len(seq.tokens) >= request.sp.max_tokens:
                finish = "length"
            if request.on_token is not None:
                request.on_token(seq.prompt_index, seq.sample_index, tok, lp, top[row] if top else None, finish)
            if finish:
                self._finish(s, finish)

    def _finish(self, slot: int, reason: str) -> None:
        seq = self.active.pop(slot)
        if seq.cache_key is not None:  # its cache holds every token but the last sampled one
            length = int(self.pos[slot])
            ids = (seq.prompt_ids + seq.tokens)[:length]
            self.s.kept.keep(seq.cache_key, ids, self.cache, slot, self.kv_version[slot])
        seq.request.finish(seq, reason)
        self.is_active[slot] = False
        heapq.heappush(self.free, slot)
