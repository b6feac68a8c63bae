"""postrl's native Rollout Worker: continuous batching over a static KV cache.

- A fixed set of decode slots. A finished sequence frees its slot at once and the next waiting
  prompt is admitted into it in the same iteration.
- Prefix sharing: a prompt is prefilled once; its K/V are copied into the slots of its other
  G-1 samples, which then sample independently.
- Prefill packs several prompts into one flat token list (no padding) with a block-diagonal
  causal mask.
- Every iteration samples all rows (decode and newly prefilled) in one call.
- bf16 on CPUs with AMX (or any dtype asked for), the same code on CUDA.
- Calls join: a ``generate`` made while another runs (another thread: an episode, a server
  request) joins its loop between two decode steps and returns when its own samples are done, so
  concurrent callers share one batch without waiting for each other (see
  :mod:`postrl.rollout.native.decode_loop`). The loop runs on the engine's scheduler thread.
- In-flight weight updates: weights that arrive (from another thread) while a ``generate`` runs
  are swapped in between two decode iterations; the in-flight sequences continue from their
  prefix, whose KV cache is recomputed under the new weights (``kv_after_update="recompute"``) or
  kept (``"keep"``). Every token records the version of the weights that produced it and the oldest
  version in the cache it attended to.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from postrl.models.host_memory import return_freed_memory
from postrl.models.weights import WeightSyncError
from postrl.rollout.common import EngineBase, non_finite
from postrl.rollout.hf_engine import eos_ids
from postrl.rollout.native.decode_loop import DecodeLoop
from postrl.rollout.native.kv_cache import KeptCaches, KVCache
from postrl.rollout.native.loop_state import LoopState
from postrl.rollout.native.model import NativeCausalLM
from postrl.rollout.native.sequences import Request, SamplingKey, Sequence, sampling_key
from postrl.types import Health, Prompt, Rollout, SamplingParams, TokenCallback, compact_versions
from postrl.types.metric_names import ROLLOUT_DECODE_S, ROLLOUT_PREFILL_S, ROLLOUT_UPDATES_MID_GENERATE

log = logging.getLogger(__name__)


@dataclass
class _PendingWeights:
    state: dict[str, torch.Tensor]
    version: int
    manifest: dict[str, str] | None
    error: BaseException | None = None
    applied: bool = False


class NativeRolloutWorker(EngineBase):
    streams_tokens = True
    joins_calls = True

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
        self._swap = threading.Condition()  # guards _generating and _pending
        self._generating = False
        self._pending: _PendingWeights | None = None
        self._inbox: list[Request] = []  # generate calls not yet in a loop (guarded by _swap)
        self._loop: DecodeLoop | None = None  # the loop in progress, driven by one caller at a time
        self._driving = False  # a caller runs the loop (or a health check): guarded by _swap
        self._helper: threading.Thread | None = None  # runs the loop handed over by a caller
        self._helper_turn = threading.Event()
        self._closed = False
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.cache_reuse_ratio = cache_reuse_ratio
        self.release_cache = release_cache
        self.generator = torch.Generator(device=model.device).manual_seed(seed)
        self.weight_version = 0
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.kept = KeptCaches(kept_cache_mb << 20)  # finished sequences' K/V by Prompt.cache_key
        self.loop_state = LoopState(
            model,
            tokenizer,
            frozenset(eos),
            self.generator,
            self,
            self.kept,
            max_batch_size,
            max_prefill_tokens,
            cache_reuse_ratio,
            kv_after_update,
        )
        self.stats = self.loop_state.stats

    @property
    def cache(self) -> KVCache | None:
        """The KV cache (the last loop's; None once released)."""
        return self.loop_state.cache

    @property
    def updates_in_flight(self) -> int:
        """Weight updates applied in the middle of a generate."""
        return self.loop_state.updates_in_flight

    @staticmethod
    def from_hf(
        model: torch.nn.Module, tokenizer: Any, dtype: torch.dtype = torch.float32, exact: bool = False, **kw: Any
    ) -> NativeRolloutWorker:
        device = next(model.parameters()).device
        return NativeRolloutWorker(
            NativeCausalLM.from_hf(model, dtype, device, exact=exact), tokenizer, eos_ids(model, tokenizer), **kw
        )

    # -- RolloutWorker interface -----------------------------------------------------------------
    def generate(
        self,
        prompts: list[Prompt],
        sampling_params: SamplingParams,
        weight_version: int | None,
        on_token: TokenCallback | None = None,
    ) -> list[Rollout]:
        """``on_token`` (optional) sees every token as it is sampled, for streaming. A call made
        while a loop with the same sampling runs joins it; a seed applies to a call that starts a
        loop."""
        self.check_version(weight_version)
        if not prompts:
            return []
        request = Request(prompts, sampling_params, on_token)
        with self._swap:
            self._inbox.append(request)
            drive, self._driving = not self._driving, True
        if drive:
            self._drive(request)
        request.wake.wait()  # answered by whoever ran the loop
        seqs = request.done.result()
        return [self._rollout(s, finish, bool(sampling_params.top_logprobs)) for s, finish in seqs]

    def _drive(self, mine: Request | None) -> None:
        """Run the engine's loop in this thread until ``mine`` is answered (None: until the loop and
        the calls waiting are all done), then hand what is left to the engine's helper thread. A
        lone caller (a training step's generate) runs the loop on its own thread from start to end;
        with callers that overlap (episodes), the helper runs it and each caller only waits for its
        answer. A loop that fails fails every call in it."""
        until = mine.done.done if mine is not None else None
        try:
            while True:
                loop = self._loop or self._start_loop()
                if loop is None:
                    return
                try:
                    finished = loop.run(until=until)
                except BaseException as exc:
                    failure = (
                        exc if isinstance(exc, Exception) else RuntimeError(f"the decode loop was stopped: {exc!r}")
                    )
                    loop.fail(failure)
                    self._end_loop()
                    if mine is not None or not isinstance(exc, Exception):
                        raise
                    log.exception("the native engine's decode loop failed")
                    continue
                if finished:
                    self._end_loop()
                if mine is not None:
                    return
        finally:
            with self._swap:
                self._hand_off()

    def _hand_off(self) -> None:
        """Wake the helper thread to run the loop or the calls waiting (``_driving`` stays True);
        with none, nobody drives. Call with ``_swap`` held."""
        if (self._loop is not None and self._loop.unanswered() is not None) or self._inbox:
            if self._helper is None or not self._helper.is_alive():
                threads = torch.get_num_threads()  # the caller's: one more OpenMP team slows the others
                self._helper = threading.Thread(
                    target=self._help, args=(threads,), name="postrl-native-loop", daemon=True
                )
                self._helper.start()
            self._helper_turn.set()
        else:
            self._driving = False
            self._swap.notify_all()  # a health check may be waiting

    def _help(self, threads: int) -> None:
        """The helper thread: runs the loop whenever a caller hands it over, until the engine closes."""
        torch.set_num_threads(threads)
        while True:
            self._helper_turn.wait()
            self._helper_turn.clear()
            self._drive(None)  # after close() too: calls already made are answered
            if self._closed:
                return

    def close(self) -> None:
        """Stop the helper thread once it has answered the calls made (it exits after its next run)."""
        with self._swap:
            self._closed = True
            if not self._driving and self._helper is not None and self._helper.is_alive():
                self._driving = True  # the helper takes the role, finds nothing to run and exits
                self._helper_turn.set()

    def _start_loop(self) -> DecodeLoop | None:
        """A loop for the oldest waiting call (the others that sample alike join it); None when no
        call waits."""
        with self._swap:
            if not self._inbox:
                return None
            first = self._inbox.pop(0)
            self._generating = True
            self.loop_state.suspending.clear()
        try:
            self._loop = DecodeLoop(self.loop_state, first, self._joiners)
        except BaseException as exc:
            first.fail(exc)
            raise
        return self._loop

    def _end_loop(self) -> None:
        """The loop is done (or failed): weights that arrived meanwhile go in, and the cache is
        released unless asked to keep it."""
        if self._loop is not None:
            self.loop_state.slots_hint = self._loop.n_slots
        self._loop = None
        if self.release_cache:  # a trainer in this process or on this GPU gets the memory back
            self.loop_state.cache = None
            return_freed_memory()  # on the host too (postrl.models.host_memory says why)
        with self._swap:
            self._generating = False
            self.loop_state.suspending.clear()
            self.apply_pending_weights()

    def _joiners(self, key: SamplingKey) -> list[Request]:
        """The waiting calls that sample like the running loop (``key``), in the order they came."""
        with self._swap:
            if not self._inbox:
                return []
            joined = [r for r in self._inbox if sampling_key(r.sp) == key]
            self._inbox = [r for r in self._inbox if sampling_key(r.sp) != key]
            return joined

    def _rollout(self, s: Sequence, finish: str, with_top: bool) -> Rollout:
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
    def _alone(self) -> Iterator[None]:
        """The engine to itself (a health check): no loop in progress, none started meanwhile;
        weights arriving meanwhile wait for :meth:`apply_pending_weights`."""
        with self._swap:
            self._swap.wait_for(lambda: not self._driving and self._loop is None)
            self._driving = True
            self._generating = True
            self.loop_state.suspending.clear()
        try:
            yield
        finally:
            with self._swap:
                self._generating = False
                self.loop_state.suspending.clear()
                self.apply_pending_weights()
                self._hand_off()  # calls made during the check

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Each sequence's logprob of every token after its first, by this engine's model and kernels
        (between decode loops, with the engine to itself)."""
        with self._alone():
            return [self.model.sequence_logprobs(ids) for ids in sequences]

    def counters(self) -> dict[str, float]:
        return {
            ROLLOUT_PREFILL_S: self.stats["prefill_s"],
            ROLLOUT_DECODE_S: self.stats["decode_s"],
            ROLLOUT_UPDATES_MID_GENERATE: float(self.updates_in_flight),
        }

    def suspend(self) -> bool:
        """Ask the generate in progress (another thread's) to return before its next decode step:
        its unfinished samples come back ``suspended`` with the tokens sampled so far, those not yet
        admitted with none. True when a generate was running."""
        with self._swap:
            if self._generating:
                self.loop_state.suspending.set()
            return self._generating

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
        if self._pending is None:  # read without the lock: a loop asks at every step
            return False
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

    def health(self) -> Health:
        """Finite weights, a KV cache that matches the model, and one greedy token generated through
        the real scheduler (into slot 0 of the existing cache, whose contents are scratch between
        loops); it waits for the loop in progress to end. The sampling generator is left as it was:
        a check (after every weight sync, and once more on resume) must not move the samples."""
        bad = non_finite(list(self.model.params.items()))
        if bad:
            return Health(False, f"non-finite weights in {bad[:3]}")
        cfg = self.model.cfg
        probe = Prompt(text="", prompt_ids=[self.pad_id])
        with self._alone():
            cache = self.cache or self.loop_state.ensure_cache(1, 2)
            layers, kv_shape = len(cache.k), tuple(cache.k[0].shape)
            if layers != cfg.layers or kv_shape[1] != cfg.kv_heads or kv_shape[3] != cfg.head_dim:
                return Health(
                    False,
                    f"KV cache of {layers} layers x {kv_shape} does not match the model "
                    f"({cfg.layers} layers, {cfg.kv_heads} KV heads of {cfg.head_dim})",
                )
            request = Request([probe], SamplingParams(n=1, temperature=0.0, max_tokens=1))
            drawn_from = self.loop_state.generator.get_state()
            try:
                DecodeLoop(self.loop_state, request, suspendable=False).run()
            finally:
                self.loop_state.generator.set_state(drawn_from)
        seqs = request.done.result(timeout=0)
        tokens, logprobs = seqs[0][0].tokens, seqs[0][0].logprobs
        if len(tokens) != 1 or not 0 <= tokens[0] < self.model.embed.shape[0] or not math.isfinite(logprobs[0]):
            return Health(False, f"generating one token gave {tokens} with logprobs {logprobs}")
        return Health(True)
