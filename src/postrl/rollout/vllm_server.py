"""A small vLLM rollout server: needs only vLLM, FastAPI, uvicorn and safetensors (no postrl).

Runs inside the vLLM virtual environment (``scripts/setup_vllm.sh``), started by
:class:`postrl.rollout.vllm_backend.VLLMRolloutWorker`::

    .venv-vllm/bin/python src/postrl/rollout/vllm_server.py --model DIR --port N

- ``POST /v1/completions``: OpenAI-style, prompts as token-id lists, with sampled-token logprobs
  and the generated token ids (``token_ids``) in every choice.
- ``POST /update_weights`` ``{path, version}``: reloads a safetensors file into the running
  engine and resets the prefix cache. On vLLM's CPU backend a direct ``load_weights`` fails;
  ``collective_rpc`` into each worker's ``reload_weights(weights_path=..., is_checkpoint_format=True)``
  works. Posted while a batch generates, the weights are swapped in between two engine steps
  (the in-flight requests keep their KV cache and go on: vLLM's ``pause_generation(mode="keep")``
  semantics, here in the offline engine this server steps itself) and the call returns once they
  are; every token's version is in the answer.
- ``POST /update_weights`` ``{adapter, version}`` (a server started with ``--max-lora-rank``): a
  peft adapter folder becomes the policy's LoRA adapter, applied unmerged by vLLM's LoRA layers,
  from the next engine step on; it always has the same adapter id, so requests already running
  go on with the new adapter, as they do with new weights.
- ``POST /suspend``: the batch generating now returns at once, its unfinished samples
  ``suspended`` with their tokens so far (requests aborted between two steps).
- ``GET /health``: ``{status, weight_version, generating, steps}`` (the engine steps of the batch
  generating now).

Protected like postrl's other servers (:mod:`postrl.workers.http_guard`, loaded by path since postrl is
not installed here): a bearer token from ``--token-env`` on every endpoint, a body limit, bounds
on ``n``, ``max_tokens`` and prompts per request, ``/update_weights`` confined to
``--weights-dir``; a non-loopback ``--host`` without a token is refused.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

if TYPE_CHECKING:  # postrl is not installed where this runs: the module is loaded by path below
    from postrl.rollout.vllm_engine_control import EngineControl


def _load_sibling(name: str, relative: Path) -> Any:
    """A module of postrl's package by its path (postrl itself is not installed in vLLM's
    environment; the modules loaded this way import only the standard library)."""
    path = Path(__file__).resolve().parent.parent / relative
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


guard = _load_sibling("postrl_serve_guard", Path("workers") / "http_guard.py")
engine_control = _load_sibling("postrl_vllm_engine_control", Path("rollout") / "vllm_engine_control.py")


def generate_stepwise(control: EngineControl, prompts: list[list[int]], params: list[Any]) -> list[dict]:
    """The batch's samples (one request each, in prompt order), stepped through vLLM's engine:
    weights posted meanwhile are swapped in between two steps, and each token records the version
    whose step produced it; a suspend aborts what is unfinished. The caller holds the engine."""
    from vllm.inputs import TokensPrompt

    engine = control.llm.llm_engine
    if control.prefix_stale and control.llm.reset_prefix_cache():
        control.prefix_stale = False
    with control.cv:
        control.generating, control.suspending, control.steps = True, False, 0
        start_version = control.version
    order: list[tuple[str, int]] = []
    try:
        for i, prompt in enumerate(prompts):
            for k, sample_params in enumerate(params):
                rid = f"postrl-{time.monotonic_ns()}-{i}-{k}"
                engine.add_request(
                    rid, TokensPrompt(prompt_token_ids=prompt), sample_params, lora_request=control.adapter
                )
                order.append((rid, i))
        latest: dict[str, Any] = {}
        versions: dict[str, list[int]] = {rid: [] for rid, _ in order}
        while engine.has_unfinished_requests():
            control.apply_pending()
            with control.cv:
                suspending, version = control.suspending, control.version
            if suspending:
                engine.abort_request([rid for rid, _ in order if rid not in latest or not latest[rid][1]])
                break
            outputs = engine.step()
            with control.cv:
                control.steps += 1
            for out in outputs:
                completion = out.outputs[0]
                seen = versions[out.request_id]
                seen += [version] * (len(completion.token_ids) - len(seen))
                latest[out.request_id] = (completion, out.finished)
    finally:
        with control.cv:
            control.generating = False
        control.apply_pending()  # weights posted after the last step
    return [
        _choice(n, i, latest.get(rid), versions[rid], start_version, control.version)
        for n, (rid, i) in enumerate(order)
    ]


class CompletionRequest(BaseModel):
    prompt: list[list[int]] = Field(min_length=1)
    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    max_tokens: int = Field(64, ge=1)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = None
    logprobs: int | None = 0


class UpdateRequest(BaseModel):
    path: str | None = None  # a safetensors file of whole weights
    adapter: str | None = None  # or a peft adapter folder (a server started with --max-lora-rank)
    version: int = Field(ge=0)


@dataclass(frozen=True)
class RequestBounds:
    """What one /v1/completions request may ask for; a request over a bound is a 400 naming it."""

    max_n: int = 256
    max_tokens: int = 32768
    max_prompts: int = 4096

    def violation(self, req: CompletionRequest) -> str | None:
        asked = (("n", req.n, self.max_n), ("max_tokens", req.max_tokens, self.max_tokens))
        for name, value, bound in (*asked, ("prompts", len(req.prompt), self.max_prompts)):
            if value > bound:
                return f"{name}={value} is over this server's limit of {bound}"
        return None


def build_app(
    llm: Any,
    model_name: str,
    *,
    token: str | None = None,
    weights_dir: str | None = None,
    max_body_bytes: int = 64 << 20,
    bounds: RequestBounds = RequestBounds(),
    lora_enabled: bool = False,
):
    from fastapi import FastAPI, HTTPException
    from vllm import SamplingParams

    app = FastAPI(title="postrl vLLM rollout server")
    app.add_middleware(guard.BodyLimitMiddleware, limit=max_body_bytes)
    if token:
        app.add_middleware(guard.TokenMiddleware, token=token)
    control = engine_control.EngineControl(llm)  # the offline LLM is not re-entrant: one batch (or reload) at a time

    @app.get("/health")
    def health() -> dict:
        return {
            "status": "ok",
            "weight_version": control.version,
            "generating": control.generating,
            "steps": control.steps,
        }

    @app.post("/v1/completions")
    def completions(req: CompletionRequest) -> dict:
        if (problem := bounds.violation(req)) is not None:
            raise HTTPException(400, problem)
        params = [_sampling_params(req, SamplingParams, k) for k in range(req.n)]
        with control.engine_lock:
            choices = generate_stepwise(control, req.prompt, params)
        return {"object": "text_completion", "model": model_name, "choices": choices, "weight_version": control.version}

    @app.post("/suspend")
    def suspend() -> dict:
        with control.cv:
            control.suspending = control.generating
            return {"suspended": control.suspending}

    @app.post("/update_weights")
    def update_weights(req: UpdateRequest) -> dict:
        where = _update_source(req, weights_dir, lora_enabled, HTTPException)
        error = control.update(where, req.version, adapter=req.adapter is not None)
        if error is not None:
            raise HTTPException(400, f"could not load {req.path or req.adapter}: {type(error).__name__}: {error}")
        return {"status": "ok", "weight_version": req.version}

    return app


def _sampling_params(req: CompletionRequest, sampling_params: Any, sample: int) -> Any:
    """vLLM's SamplingParams of a request's ``sample``-th sample (each sample is a request of its
    own, so it can be stepped, versioned and aborted alone): sampled-token logprobs, stop strings
    kept in the text, the seed offset by the sample."""
    return sampling_params(
        n=1,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k if req.top_k > 0 else -1,
        max_tokens=req.max_tokens,
        stop=req.stop or None,
        stop_token_ids=req.stop_token_ids or None,
        seed=None if req.seed is None else req.seed + sample,
        logprobs=0,
        include_stop_str_in_output=True,
    )


def _choice(
    index: int, prompt_index: int, latest: tuple[Any, bool] | None, versions: list[int], start: int, now: int
) -> dict:
    """One sample's answer. ``kv_versions``: with weights swapped mid-batch, the oldest weights that
    may be behind the cache each token read (the batch's first: its cache is kept across the swap,
    and a prompt's blocks may come from the prefix cache of that version); None when all are one."""
    completion, finished = latest if latest is not None else (None, False)
    tokens = list(completion.token_ids) if completion is not None else []
    logprobs = [step[tok].logprob for tok, step in zip(tokens, (completion.logprobs or []) if completion else [])]
    if not finished:
        reason = "suspended"
    else:
        reason = "stop" if completion.finish_reason == "stop" else "length"
    uniform = now == start
    return {
        "index": index,
        "prompt_index": prompt_index,
        "text": completion.text if completion is not None else "",
        "token_ids": tokens,
        "logprobs": {"token_logprobs": logprobs},
        "finish_reason": reason,
        "logprob_versions": None if uniform else versions,
        "kv_versions": None if uniform else [start] * len(tokens),
        "weight_version": start,
    }


def _update_source(req: UpdateRequest, weights_dir: str | None, lora_enabled: bool, http_error: Any) -> str:
    """Where an /update_weights request's weights file or adapter folder is (400 or 403 otherwise)."""
    if (req.path is None) == (req.adapter is None):
        raise http_error(400, "/update_weights takes one of path (a weights file) or adapter (a folder)")
    if req.adapter is not None and not lora_enabled:
        raise http_error(400, "this server was started without LoRA (--max-lora-rank): it takes whole weights")
    if req.adapter is not None:
        return _weights_file(weights_dir, req.adapter, http_error, folder=True)
    return _weights_file(weights_dir, req.path, http_error)


def _weights_file(weights_dir: str | None, path: str, http_error: Any, folder: bool = False) -> str:
    """The file (``folder``: the adapter folder) /update_weights may read: under ``weights_dir``
    (403 otherwise) and existing (else 400)."""
    if weights_dir is None:
        raise http_error(403, "/update_weights is disabled: start the server with --weights-dir DIR")
    try:
        full = guard.confined_path(weights_dir, path)
    except ValueError as exc:
        raise http_error(403, str(exc)) from None
    if folder and not os.path.isfile(os.path.join(full, "adapter_config.json")):
        raise http_error(400, f"no adapter folder (adapter_config.json) at {path}")
    if not folder and not os.path.isfile(full):
        raise http_error(400, f"no weights file at {path}")
    return full


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="postrl vLLM rollout server")
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8200)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--memory-fraction", type=float, default=0.25, help="CPU memory vLLM reserves for its KV cache")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-lora-rank", type=int, default=0, help="take LoRA adapters up to this rank (vLLM's next size up); 0: off"
    )
    parser.add_argument("--token-env", help="environment variable holding the bearer token every request needs")
    parser.add_argument("--weights-dir", help="the only folder /update_weights may read from (default: disabled)")
    parser.add_argument("--max-body-bytes", type=int, default=64 << 20)
    parser.add_argument("--max-n", type=int, default=256)
    parser.add_argument("--max-tokens-limit", type=int, default=32768)
    parser.add_argument("--max-prompts", type=int, default=4096)
    return parser.parse_args()


def _lora_options(max_lora_rank: int) -> dict[str, Any]:
    """vLLM's LoRA settings for adapters up to ``max_lora_rank`` (its next size up); none for 0."""
    if max_lora_rank <= 0:
        return {}
    ranks = engine_control.LORA_RANKS
    rank = min((r for r in ranks if r >= max_lora_rank), default=None)
    if rank is None:
        sys.exit(f"vllm_server: --max-lora-rank {max_lora_rank} is over vLLM's largest, {ranks[-1]}")
    return {"enable_lora": True, "max_lora_rank": rank, "max_loras": 1}


def main() -> None:
    args = _arguments()
    try:
        token = guard.read_token(args.token_env)
    except ValueError as exc:
        sys.exit(f"vllm_server: {exc}")
    if not guard.is_loopback(args.host) and token is None:
        sys.exit(f"vllm_server: --host {args.host} is not loopback; set --token-env (a bearer token)")

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # step() runs the engine step itself
    import uvicorn
    from vllm import LLM

    lora = _lora_options(args.max_lora_rank)
    llm = LLM(
        async_scheduling=False,  # a step's tokens are its weights': none computed ahead of a swap
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        seed=args.seed,
        gpu_memory_utilization=args.memory_fraction,
        enable_prefix_caching=True,  # a multi-turn episode's next turn reuses its context's cached blocks
        **lora,
    )
    bounds = RequestBounds(args.max_n, args.max_tokens_limit, args.max_prompts)
    app = build_app(
        llm,
        args.model,
        token=token,
        weights_dir=args.weights_dir,
        max_body_bytes=args.max_body_bytes,
        bounds=bounds,
        lora_enabled=bool(lora),
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
