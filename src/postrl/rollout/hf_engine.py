"""The fallback Rollout Worker: any Hugging Face causal LM, batched decoding with its KV cache.

Used for architectures the native engine (:mod:`postrl.rollout.native`) does not implement.

Prompts are left-padded into batches of at most ``max_batch_size`` sequences (the G samples of
a prompt are rows of the same batch); every step samples all running rows in one call. The
engine owns its random generator, so rollouts are reproducible and resumable.
"""

from __future__ import annotations

import inspect
import logging
import math
import threading
from pathlib import Path
from typing import Any

import torch

from postrl.models.weights import load_state_checked
from postrl.rollout.common import EngineBase, non_finite
from postrl.rollout.sampling import sample_tokens, top_logprobs
from postrl.rollout.stops import StopChecker
from postrl.rollout.streams import derive, prompt_key, uniforms
from postrl.types import Health, Prompt, Rollout, SamplingParams, TokenCallback

log = logging.getLogger(__name__)


def cache_argument(model: Any) -> str:
    """transformers >= 5.2x names the KV cache ``cache``; older releases ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def output_cache(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    cfg = getattr(model, "generation_config", None)
    eos = getattr(cfg, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class HFRolloutWorker(EngineBase):
    streams_tokens = True

    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_batch_size: int = 256, seed: int = 0) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
        self.weight_version = 0
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self._eos = eos_ids(model, tokenizer)
        self._cache_arg = cache_argument(model)
        # generate, weight updates and health checks one at a time: weights arriving from another
        # thread (async training) wait for the generate in progress (no in-flight swap here)
        self._busy = threading.RLock()

    # -- RolloutWorker interface -------------------------------------------------------------
    def generate(
        self,
        prompts: list[Prompt],
        sampling_params: SamplingParams,
        weight_version: int | None,
        on_token: TokenCallback | None = None,
    ) -> list[Rollout]:
        """``on_token`` (optional) sees every token as it is sampled, for streaming."""
        with self._busy:
            self.check_version(weight_version)
            sp = sampling_params
            rows = [(i, k, p.prompt_ids) for i, p in enumerate(prompts) for k in range(sp.n)]
            streams = [prompt_key(p.stream, sp.seed, i, self.generator) for i, p in enumerate(prompts)]
            keys = [derive(streams[i], k) for i, k, _ in rows]
            out: list[Rollout] = []
            for start in range(0, len(rows), self.max_batch_size):
                end = start + self.max_batch_size
                out.extend(self._generate_batch(rows[start:end], sp, on_token, keys[start:end]))
            return out

    def update_weights(
        self, weights: dict[str, torch.Tensor] | str | Path, version: int, manifest: dict[str, str] | None = None
    ) -> None:
        source = str(weights) if isinstance(weights, (str, Path)) else "an in-memory state dict"
        with self._busy:
            load_state_checked(self.model, self.verified_state(weights, manifest), source)
            self.weight_version = version

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Each sequence's logprob of every token after its first: one transformers forward each."""
        device = next(self.model.parameters()).device
        out = []
        with torch.no_grad():
            for ids in sequences:
                tokens = torch.tensor([ids], device=device)
                logp = torch.log_softmax(self.model(input_ids=tokens).logits[0, :-1].float(), dim=-1)
                out.append(logp.gather(-1, tokens[0, 1:].unsqueeze(-1)).squeeze(-1).cpu().tolist())
        return out

    def health(self) -> Health:
        """Finite weights, and one greedy token from a one-token prompt."""
        with self._busy:
            return self._health_check()

    def _health_check(self) -> Health:
        if self.model.training:
            return Health(False, "the rollout model is in training mode")
        bad = non_finite(list(self.model.named_parameters()))
        if bad:
            return Health(False, f"non-finite weights in {bad[:3]}")
        probe = self._generate_batch([(0, 0, [self.pad_id])], SamplingParams(n=1, temperature=0.0, max_tokens=1))[0]
        if len(probe.response_ids) != 1 or not math.isfinite(probe.logprobs[0]):
            return Health(False, f"generating one token gave {probe.response_ids} with logprobs {probe.logprobs}")
        return Health(True)

    # -- internals -------------------------------------------------------------------------------
    def _left_padded(self, rows: list[tuple[int, int, list[int]]], device: torch.device) -> tuple[torch.Tensor, ...]:
        n, width = len(rows), max(len(ids) for _, _, ids in rows)
        input_ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((n, width), dtype=torch.long)
        for r, (_, _, ids) in enumerate(rows):
            input_ids[r, width - len(ids) :] = torch.tensor(ids)
            attention[r, width - len(ids) :] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        return input_ids, attention, (attention.cumsum(-1) - 1).clamp(min=0)

    @torch.no_grad()
    def _generate_batch(
        self,
        rows: list[tuple[int, int, list[int]]],
        sp: SamplingParams,
        on_token: TokenCallback | None = None,
        keys: list[int] | None = None,
    ) -> list[Rollout]:
        """``keys``: each row's random stream (:mod:`postrl.rollout.streams`; None: greedy only)."""
        device = next(self.model.parameters()).device
        streams = torch.tensor(keys if keys is not None else [0] * len(rows), dtype=torch.long, device=device)
        input_ids, attention, positions = self._left_padded(rows, device)
        n = len(rows)
        stop_tensor = torch.tensor(sorted(self._eos | set(sp.stop_token_ids)), dtype=torch.long, device=device)
        record = _BatchRecord(rows, sp, StopChecker(self.tokenizer, sp.stop), on_token)
        done = torch.zeros(n, dtype=torch.bool, device=device)

        out = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True)
        cache, next_logits = output_cache(out), out.logits[:, -1, :]
        next_pos = positions[:, -1:] + 1
        for step in range(sp.max_tokens):
            u = uniforms(streams, torch.full_like(streams, step))
            tokens, token_lp = sample_tokens(next_logits, sp.temperature, sp.top_k, sp.top_p, u)
            tokens = torch.where(done, torch.full_like(tokens, self.pad_id), tokens)
            hit_stop_id = (torch.isin(tokens, stop_tensor) & ~done).tolist()
            top = top_logprobs(next_logits, sp.temperature, sp.top_logprobs) if sp.top_logprobs else None
            for r in record.add(
                tokens.tolist(), token_lp.tolist(), top, hit_stop_id, (~done).nonzero().flatten().tolist()
            ):
                done[r] = True
            if bool(done.all()):
                break
            attention = torch.cat([attention, attention.new_ones((n, 1))], dim=-1)
            out = self.model(
                input_ids=tokens.unsqueeze(-1),
                attention_mask=attention,
                position_ids=next_pos,
                use_cache=True,
                **{self._cache_arg: cache},
            )
            cache, next_logits = output_cache(out), out.logits[:, -1, :]
            next_pos = next_pos + 1
        return record.rollouts(self.tokenizer, self.weight_version)


class _BatchRecord:
    """What one batch has generated so far, row by row, and who to tell about each token."""

    def __init__(
        self,
        rows: list[tuple[int, int, list[int]]],
        sp: SamplingParams,
        checker: StopChecker,
        on_token: TokenCallback | None,
    ) -> None:
        self.rows = rows
        self.sp = sp
        self.checker = checker
        self.on_token = on_token
        self.responses: list[list[int]] = [[] for _ in rows]
        self.logprobs: list[list[float]] = [[] for _ in rows]
        self.tops: list[list[list[tuple[int, float]]]] = [[] for _ in rows]
        self.finish: list[str] = ["length"] * len(rows)

    def add(
        self, tokens: list[int], lps: list[float], top: list | None, hit_stop_id: list[bool], active: list[int]
    ) -> list[int]:
        """Append this step's token to every active row; returns the rows that stopped."""
        stopped = []
        for r in active:
            self.responses[r].append(tokens[r])
            self.logprobs[r].append(lps[r])
            if top is not None:
                self.tops[r].append(top[r])
            ended = None
            if hit_stop_id[r] or self.checker.hit(self.responses[r]):
                self.finish[r] = ended = "stop"
                stopped.append(r)
            elif len(self.responses[r]) >= self.sp.max_tokens:
                ended = "length"
            if self.on_token is not None:
                self.on_token(self.rows[r][0], self.rows[r][1], tokens[r], lps[r], top[r] if top else None, ended)
        return stopped

    def rollouts(self, tokenizer: Any, weight_version: int) -> list[Rollout]:
        return [
            Rollout(
                prompt_index=idx,
                prompt_ids=list(ids),
                response_ids=self.responses[r],
                logprobs=self.logprobs[r],
                text=tokenizer.decode(self.responses[r], skip_special_tokens=True),
                finish_reason=self.finish[r],  # type: ignore[arg-type]
                weight_version=weight_version,
                top_logprobs=self.tops[r] if self.sp.top_logprobs else None,
            )
            for r, (idx, _, ids) in enumerate(self.rows)
        ]
