"""The ``rollout:`` section: how responses are generated (backend, sampling, weight sync, exact
mode) and the knobs of the native and vLLM engines."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from postrl.config.base import DEVICE_PATTERN, Section


class NativeEngineConfig(Section):
    max_prefill_tokens: int = Field(
        2048,
        ge=1,
        description="Prompt tokens prefilled together when prompts are admitted (one packed pass); "
        "a longer prompt still goes alone.",
    )
    cache_reuse_ratio: float = Field(
        2.0,
        ge=1.0,
        description="A KV cache from an earlier call is reused when it fits and is at most this many "
        "times longer than the call needs (decode attends over the cache's whole length, so a far too long one "
        "costs more than a new allocation).",
    )
    release_cache: bool = Field(
        True,
        description="Free the KV cache when a generate call returns, so that training in the same process "
        "(or on the same GPU) gets that memory back; the next call allocates it again (a zero fill). false "
        "keeps it for the next call (cache_reuse_ratio).",
    )
    kept_cache_mb: int = Field(
        1024,
        ge=0,
        description="Megabytes of K/V kept between calls for prompts with a cache key (a multi-turn "
        "episode's context between its turns, so the next turn prefills only the new tokens); 0 keeps none.",
    )


class VLLMEngineConfig(Section):
    max_model_len: int | None = Field(
        None,
        ge=16,
        description="vLLM's max_model_len: prompt plus response tokens. None: data.max_prompt_tokens + "
        "rollout.max_tokens (what the run needs, within the model's context); a value over the model's context "
        "is refused before vLLM starts.",
    )
    memory_fraction: float = Field(
        0.25,
        gt=0.0,
        le=1.0,
        description="Memory vLLM reserves for its KV cache (gpu_memory_utilization; on CPU, a fraction of RAM).",
    )
    startup_timeout_s: float = Field(600.0, gt=0.0, description="How long the server may take to start.")
    request_timeout_s: float = Field(3600.0, gt=0.0, description="How long one generate request may take.")


class RolloutConfig(Section):
    backend: Literal["auto", "native", "hf", "vllm", "openai"] = Field(
        "auto",
        description="native: postrl's engine (Llama/Qwen2/Mistral); hf: the transformers model; auto: native if "
        "supported; vllm: a vLLM server in .venv-vllm (scripts/setup_vllm.sh); openai: running OpenAI-compatible "
        "rollout servers at rollout.url (postrl serve-rollout, or postrl route in front of several).",
    )
    url: str | None = Field(None, description="rollout.backend=openai: the server's (or router's) base URL.")
    api_key_env: str | None = Field(None, description="rollout.backend=openai: env var holding the servers' token.")
    n: int = Field(8, ge=1, description="Responses per prompt (the GRPO group size G).")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass; 1 disables it.")
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    max_tokens: int = Field(64, ge=1, description="Maximum new tokens per response.")
    stop: list[str] = Field(default_factory=list, description="Stop strings (kept in the response).")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=list, description="Extra stop tokens besides EOS."
    )
    max_batch_size: int = Field(256, ge=1, description="Sequences decoded together.")
    dtype: Literal["auto", "float32", "bfloat16"] | None = Field(
        None, description="Engine dtype; None = model.dtype; auto = bfloat16 where the hardware has fast bf16."
    )
    device: str = Field(
        "auto",
        pattern=DEVICE_PATTERN,
        description="Where the engine's weights and KV cache live: auto (CUDA when present), cpu, cuda, cuda:N.",
    )
    verify_sync: bool = Field(
        True, description="Checksum every weight sync and compare what arrived with what was sent."
    )
    weight_sync: Literal["memory", "safetensors", "broadcast"] = Field(
        "memory",
        description="How new weights reach the engines: memory (the state dict, handed over or sent to the "
        "engine's process), safetensors (one file in sync_dir that every engine loads), broadcast (a "
        "torch.distributed group from the driver to the engines, in buckets of sync_bucket_mb).",
    )
    sync_dir: str | None = Field(
        None,
        description="Folder for weight_sync=safetensors; on a cluster, shared storage "
        "every engine can read. None: a temporary folder on this machine.",
    )
    sync_bucket_mb: int = Field(64, ge=1, description="weight_sync=broadcast: megabytes per broadcast bucket.")
    kv_after_update: Literal["keep", "recompute"] = Field(
        "keep",
        description="New weights arriving mid-generation (async mode): in-flight sequences pause, the weights are "
        "swapped, and their prefix's KV cache is kept as the old weights computed it (keep; each token then also "
        "records the version of the cache it attended to) or recomputed under the new weights (recompute: 5-8% "
        "more wall time on the demo, the same accuracy; docs/async.md).",
    )
    exact: bool = Field(
        False,
        description="Exactly on-policy: the native engine and the trainer compute every token through the same "
        "batch-invariant operations (fixed 32-row tiles, attention over fixed 64-position key blocks) from the "
        "same weights, so each sampled token's logprob equals the trainer's recomputation bit for bit, whatever "
        "the batch, and an on-policy step's importance ratio is exactly 1. Needs the "
        "native engine, no LoRA, and one compute dtype on both sides (rollout.dtype=float32 with "
        "train.precision=float32, or bfloat16 with bf16_autocast). Its cost is in docs/benchmarks.md (mismatch.py).",
    )
    native: NativeEngineConfig = Field(default_factory=NativeEngineConfig, description="The native engine's knobs.")
    vllm: VLLMEngineConfig = Field(default_factory=VLLMEngineConfig, description="The vLLM backend's knobs.")


def exact_dtype_message(dtype: str, precision: str, engine: str, trainer: str) -> str:
    """rollout.exact's error when the engine's dtype and the trainer's differ."""
    return (
        "rollout.exact needs the engine and the trainer to compute in one dtype: rollout.dtype=float32 with "
        f"train.precision=float32, or rollout.dtype=bfloat16 with train.precision=bf16_autocast (got rollout.dtype="
        f"{dtype}, train.precision={precision}: {engine} and {trainer} on this machine)"
    )
