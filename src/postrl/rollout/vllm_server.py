"""A small vLLM rollout server: needs only vLLM, FastAPI, uvicorn and safetensors (no postrl).

Runs inside the vLLM virtual environment (``scripts/setup_vllm.sh``), started by
:class:`postrl.rollout.vllm_backend.VLLMRolloutWorker`::

    .venv-vllm/bin/python src/postrl/rollout/vllm_server.py --model DIR --port N

- ``POST /v1/completions``: OpenAI-style, prompts as token-id lists, with sampled-token logprobs
  and the generated token ids (``token_ids``) in every choice.
- ``POST /update_weights`` ``{path, version}``: reloads a safetensors file into the running
  engine and resets the prefix cache. On vLLM's CPU backend a direct ``load_weights`` fails;
  ``collective_rpc`` into each worker's ``reload_weights(weights_path=..., is_checkpoint_format=True)``
  works.
- ``GET /health``: ``{status, weight_version}``.

Protected like postrl's other servers (:mod:`postrl.workers.http_guard`, loaded by path since postrl is
not installed here): a bearer token from ``--token-env`` on every endpoint, a body limit, bounds
on ``n``, ``max_tokens`` and prompts per request, ``/update_weights`` confined to
``--weights-dir``; a non-loopback ``--host`` without a token is refused.
"""

import argparse
import importlib.util
import os
import sys
import threading
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field


def _load_guard() -> Any:
    path = Path(__file__).resolve().parent.parent / "serve" / "guard.py"
    spec = importlib.util.spec_from_file_location("postrl_serve_guard", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


guard = _load_guard()


def _reload(llm: Any, path: str) -> None:
    """Reload one safetensors file into the running engine, in place.

    vLLM's worker ``reload_weights`` takes a model folder (``weights_path``); the file is linked
    into a fresh folder of its own so nothing else next to it is picked up. Only strings cross
    vLLM's process boundary (callables would need its insecure pickle fallback)."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory(prefix="postrl-reload-") as folder:
        os.symlink(os.path.abspath(path), os.path.join(folder, "model.safetensors"))
        llm.collective_rpc("reload_weights", kwargs={"weights_path": folder, "is_checkpoint_format": True})
    llm.reset_prefix_cache()


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
    path: str
    version: int = Field(ge=0)


def build_app(
    llm: Any,
    model_name: str,
    *,
    token: str | None = None,
    weights_dir: str | None = None,
    max_body_bytes: int = 64 << 20,
    max_n: int = 256,
    max_tokens: int = 32768,
    max_prompts: int = 4096,
):
    from fastapi import FastAPI, HTTPException
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    app = FastAPI(title="postrl vLLM rollout server")
    app.add_middleware(guard.BodyLimitMiddleware, limit=max_body_bytes)
    if token:
        app.add_middleware(guard.TokenMiddleware, token=token)
    lock = threading.Lock()  # the offline LLM is not re-entrant; each request is a whole batch
    state = {"weight_version": 0}

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "weight_version": state["weight_version"]}

    @app.post("/v1/completions")
    def completions(req: CompletionRequest) -> dict:
        limits = (
            ("n", req.n, max_n),
            ("max_tokens", req.max_tokens, max_tokens),
            ("prompts", len(req.prompt), max_prompts),
        )
        for name, value, bound in limits:
            if value > bound:
                raise HTTPException(400, f"{name}={value} is over this server's limit of {bound}")
        params = _sampling_params(req, SamplingParams)
        with lock:
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in req.prompt], params, use_tqdm=False)
        return {
            "object": "text_completion",
            "model": model_name,
            "choices": _choices(outputs),
            "weight_version": state["weight_version"],
        }

    @app.post("/update_weights")
    def update_weights(req: UpdateRequest) -> dict:
        path = _weights_file(weights_dir, req.path, HTTPException)
        with lock:
            try:
                _reload(llm, path)
            except Exception as exc:  # noqa: BLE001 - a bad file is the client's error
                raise HTTPException(400, f"could not load {req.path}: {type(exc).__name__}: {exc}") from None
            state["weight_version"] = req.version
        return {"status": "ok", "weight_version": req.version}

    return app


def _sampling_params(req: CompletionRequest, sampling_params: Any) -> Any:
    """vLLM's SamplingParams of a request: sampled-token logprobs, stop strings kept in the text."""
    return sampling_params(
        n=req.n,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k if req.top_k > 0 else -1,
        max_tokens=req.max_tokens,
        stop=req.stop or None,
        stop_token_ids=req.stop_token_ids or None,
        seed=req.seed,
        logprobs=0,
        include_stop_str_in_output=True,
    )


def _choices(outputs: list[Any]) -> list[dict]:
    """One choice per sample, with its prompt's index, its token ids and their logprobs."""
    choices = []
    for i, out in enumerate(outputs):
        for c in out.outputs:
            logprobs = [step[tok].logprob for tok, step in zip(c.token_ids, c.logprobs or [])]
            choices.append(
                {
                    "index": len(choices),
                    "prompt_index": i,
                    "text": c.text,
                    "token_ids": list(c.token_ids),
                    "logprobs": {"token_logprobs": logprobs},
                    "finish_reason": "stop" if c.finish_reason == "stop" else "length",
                }
            )
    return choices


def _weights_file(weights_dir: str | None, path: str, http_error: Any) -> str:
    """The file /update_weights may read: under ``weights_dir`` (403 otherwise) and existing (else 400)."""
    if weights_dir is None:
        raise http_error(403, "/update_weights is disabled: start the server with --weights-dir DIR")
    try:
        full = guard.confined_path(weights_dir, path)
    except ValueError as exc:
        raise http_error(403, str(exc)) from None
    if not os.path.isfile(full):
        raise http_error(400, f"no weights file at {path}")
    return full


def main() -> None:
    parser = argparse.ArgumentParser(description="postrl vLLM rollout server")
    parser.add_argument("--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8200)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--memory-fraction", type=float, default=0.25, help="CPU memory vLLM reserves for its KV cache")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--token-env", help="environment variable holding the bearer token every request needs")
    parser.add_argument("--weights-dir", help="the only folder /update_weights may read from (default: disabled)")
    parser.add_argument("--max-body-bytes", type=int, default=64 << 20)
    parser.add_argument("--max-n", type=int, default=256)
    parser.add_argument("--max-tokens-limit", type=int, default=32768)
    parser.add_argument("--max-prompts", type=int, default=4096)
    args = parser.parse_args()
    try:
        token = guard.read_token(args.token_env)
    except ValueError as exc:
        sys.exit(f"vllm_server: {exc}")
    if not guard.is_loopback(args.host) and token is None:
        sys.exit(f"vllm_server: --host {args.host} is not loopback; set --token-env (a bearer token)")

    import uvicorn
    from vllm import LLM

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        seed=args.seed,
        gpu_memory_utilization=args.memory_fraction,
    )
    app = build_app(
        llm,
        args.model,
        token=token,
        weights_dir=args.weights_dir,
        max_body_bytes=args.max_body_bytes,
        max_n=args.max_n,
        max_tokens=args.max_tokens_limit,
        max_prompts=args.max_prompts,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
