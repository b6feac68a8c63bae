"""Choosing the rollout backend from the config, and :class:`EngineSpec`: one engine of a run, built
the same way in this process, a child process, a Ray actor and ``postrl eval``."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from postrl.config.rollout import RolloutConfig
from postrl.config.run import RunConfig
from postrl.models import numerics
from postrl.models.devices import bf16_is_fast, resolve_device
from postrl.models.loading import context_length, load_causal_lm, resolve_model_path
from postrl.rollout.hf_engine import HFRolloutWorker
from postrl.rollout.native import SUPPORTED_MODEL_TYPES, NativeRolloutWorker
from postrl.workers.roles import RolloutWorker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSpec:
    """What builds one rollout engine: the run's ``rollout`` section, the model, the seed (each
    engine of a pool its own), the CPU threads of its process, and the LoRA rank of synced adapters."""

    rollout: RolloutConfig
    model_path: str
    model_dtype: str
    seed: int
    threads: int | None = None  # set in the engine's own process (None: torch's default)
    adapter_rank: int | None = None  # model.synced_adapter_rank

    @staticmethod
    def of_run(config: RunConfig) -> EngineSpec:
        """The first engine of the run's pool (:meth:`for_index` gives the others)."""
        m = config.model
        return EngineSpec(config.rollout, m.path, m.dtype, config.seed, None, m.synced_adapter_rank)

    def for_index(self, index: int, threads: int | None = None) -> EngineSpec:
        """Engine ``index`` of a pool whose first engine this is: its own seed, ``threads`` CPU threads."""
        return dataclasses.replace(self, seed=self.seed + index, threads=threads)

    def build(self, tokenizer: Any = None) -> RolloutWorker:
        """The engine (``tokenizer``: the run's, when it is built in the run's process)."""
        from postrl.models.loading import load_tokenizer

        if self.threads:
            torch.set_num_threads(self.threads)
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(self.model_path)
        return make_rollout_worker(
            self.rollout, self.model_path, tokenizer, self.model_dtype, self.seed, self.adapter_rank
        )


def engine_dtype(config: RolloutConfig, model_dtype: str, device: torch.device) -> torch.dtype:
    """The engine's dtype on ``device`` (:func:`postrl.models.numerics.engine_dtype`'s rule)."""
    name = numerics.engine_dtype(config.dtype or model_dtype, bf16_is_fast(device))
    return torch.bfloat16 if name == "bfloat16" else torch.float32


def make_rollout_worker(
    config: RolloutConfig,
    model_path: str,
    tokenizer: Any,
    model_dtype: str,
    seed: int,
    adapter_rank: int | None = None,
) -> RolloutWorker:
    """``auto`` uses the native engine for Llama/Qwen2/Mistral and falls back, with a warning,
    to the transformers model for any other architecture; ``vllm`` starts a vLLM server, with
    LoRA layers when syncs send adapters of ``adapter_rank`` (``model.synced_adapter_rank``; the
    native engine takes adapters of any rank)."""
    if config.backend == "openai":
        from postrl.rollout.openai_remote import OpenAIRolloutWorker

        return OpenAIRolloutWorker(config.url, tokenizer, config.sync_dir, config.api_key_env)
    if config.backend == "vllm":
        from postrl.rollout.vllm_backend import VLLMRolloutWorker

        gpu = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        dtype = numerics.engine_dtype(config.dtype or model_dtype, bf16_is_fast(gpu))
        v = config.vllm
        return VLLMRolloutWorker(
            resolve_model_path(model_path),
            tokenizer,
            dtype=dtype,
            seed=seed,
            max_model_len=v.max_model_len or context_length(model_path) or 2048,
            memory_fraction=v.memory_fraction,
            startup_timeout_s=v.startup_timeout_s,
            request_timeout_s=v.request_timeout_s,
            max_lora_rank=adapter_rank,
        )
    device = resolve_device(config.device, "rollout.device")
    return rollout_worker_for_model(
        config, load_causal_lm(model_path, "float32").to(device), tokenizer, model_dtype, seed
    )


def rollout_worker_for_model(
    config: RolloutConfig, model: torch.nn.Module, tokenizer: Any, model_dtype: str, seed: int
) -> RolloutWorker:
    """A native or transformers Rollout Worker around an already loaded model."""
    device = next(model.parameters()).device
    dtype = engine_dtype(config, model_dtype, device)
    model_type = getattr(model.config, "model_type", "?")
    backend = config.backend
    if backend == "auto":
        backend = "native" if model_type in SUPPORTED_MODEL_TYPES else "hf"
        if backend == "hf":
            log.warning("model_type '%s' has no native engine; rollouts use the slower transformers model", model_type)
    if backend == "native":
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"rollout.backend=native supports {SUPPORTED_MODEL_TYPES}, not '{model_type}'")
        return NativeRolloutWorker.from_hf(
            model,
            tokenizer,
            dtype,
            exact=config.exact,
            max_batch_size=config.max_batch_size,
            seed=seed,
            max_prefill_tokens=config.native.max_prefill_tokens,
            cache_reuse_ratio=config.native.cache_reuse_ratio,
            kv_after_update=config.kv_after_update,
            kept_cache_mb=config.native.kept_cache_mb,
            release_cache=config.native.release_cache,
        )
    if config.exact:
        raise ValueError(f"rollout.exact needs the native engine, which has no model_type '{model_type}'")
    return HFRolloutWorker(model.to(dtype), tokenizer, config.max_batch_size, seed=seed)
