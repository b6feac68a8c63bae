"""The ``postrl`` command line: train, demo, eval, servers and conversion."""

from __future__ import annotations

import argparse
import logging
import sys

from postrl.config import ConfigError


def _cmd_train(args: argparse.Namespace) -> int:
    from postrl.config import load_config
    from postrl.runner import resume_config, train

    if args.resume:
        if args.config and "=" not in args.config:
            raise ConfigError("give either CONFIG or --resume RUN_DIR, not both")
        overrides = ([args.config] if args.config else []) + args.overrides
        config = resume_config(args.resume, overrides)
    else:
        if not args.config:
            raise ConfigError("postrl train needs a CONFIG.yaml (or --resume runs/NAME)")
        config = load_config(args.config, args.overrides)
    controller = train(config, resume=bool(args.resume))
    print(f"finished {controller.step_count} steps; run directory: {config.run_dir}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from postrl.demo import run_demo

    result = run_demo(args.overrides)
    print(
        f"demo done in {result.wall_s:.0f}s: held-out accuracy {result.acc_before:.3f} -> {result.acc_after:.3f} "
        f"after {result.steps} GRPO steps ({result.run_dir})"
    )
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from postrl.evaluate import evaluate_model
    from postrl.models import load_causal_lm, load_tokenizer

    result = evaluate_model(load_causal_lm(args.model), load_tokenizer(args.model), args.task, max_tokens=args.max_tokens)
    print(f"{result.task}: held-out accuracy {result.accuracy:.3f} ({result.correct}/{result.total})")
    return 0


def _cmd_serve_rollout(args: argparse.Namespace) -> int:
    import uvicorn

    from postrl.config import RolloutConfig
    from postrl.models import load_causal_lm, load_tokenizer
    from postrl.rollout.factory import rollout_worker_for_model
    from postrl.serve.batcher import EngineBatcher
    from postrl.serve.openai_server import build_app

    tokenizer = load_tokenizer(args.model)
    model = load_causal_lm(args.model)
    rollout = RolloutConfig(backend=args.backend, dtype=args.dtype, max_batch_size=args.max_batch_size)
    worker = rollout_worker_for_model(rollout, model, tokenizer, "float32", seed=args.seed)
    batcher = EngineBatcher(worker)
    name = args.served_model_name or args.model
    max_context = getattr(model.config, "max_position_embeddings", None)
    uvicorn.run(build_app(batcher, tokenizer, name, max_context=max_context), host=args.host, port=args.port, log_level="warning")
    batcher.close()
    return 0


def _cmd_route(args: argparse.Namespace) -> int:
    import uvicorn

    from postrl.serve.router import LeastOutstandingRouter, build_router_app

    uvicorn.run(build_router_app(LeastOutstandingRouter(args.backend)), host=args.host, port=args.port, log_level="warning")
    return 0


def _cmd_serve_reward(args: argparse.Namespace) -> int:
    import os

    import uvicorn

    from postrl.config import RewardServiceFile, load_config
    from postrl.reward.server import build_reward_app
    from postrl.reward.service import RewardService

    if not args.config:
        raise ConfigError("postrl serve-reward needs --config reward.yaml (sections: reward, server)")
    cfg = load_config(args.config, args.overrides, model=RewardServiceFile)
    server = cfg.server.model_copy(update={k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None})
    token = None
    if server.token_env:
        token = os.environ.get(server.token_env)
        if not token:
            raise ConfigError(f"server.token_env={server.token_env}: that environment variable is not set")
    if server.host not in ("127.0.0.1", "localhost", "::1") and token is None:
        print(f"warning: serving rewards on {server.host} without a token (set server.token_env)", file=sys.stderr)
    service = RewardService(cfg.reward)
    if service.sandbox_protections is not None:
        on = [k for k, v in service.sandbox_protections.items() if v]
        off = [k for k, v in service.sandbox_protections.items() if not v]
        print(f"code sandbox protections active: {', '.join(on)}" + (f"; MISSING: {', '.join(off)}" if off else ""))
    names = ", ".join(f"{c.name} ({c.type}, weight {c.weight:g})" for c in service.components)
    print(f"reward service on http://{server.host}:{server.port} with {names}", flush=True)
    try:
        # keep-alive longer than uvicorn's 5 s default: a pooled client connection closed by the
        # server just as the client reuses it surfaces as a ReadError on the client
        uvicorn.run(build_reward_app(service, server, token), host=server.host, port=server.port, log_level="warning",
                    timeout_keep_alive=75)
    finally:
        service.close()
    return 0


def _cmd_convert_gguf(args: argparse.Namespace) -> int:
    from postrl.gguf import convert_gguf

    print(f"wrote {convert_gguf(args.file, args.out_dir)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="postrl", description="RL post-training of language models.")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="run GRPO/PPO from a YAML config")
    p.add_argument("config", nargs="?", help="CONFIG.yaml")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.lr=1e-5")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue runs/NAME from its latest checkpoint")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("demo", help="GRPO on the built-in arithmetic task with the shipped model")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. steps=20")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("eval", help="held-out accuracy of a model on a built-in task")
    p.add_argument("--model", required=True, help="a Hugging Face model folder, or 'demo'")
    p.add_argument("--task", default="arithmetic")
    p.add_argument("--max-tokens", type=int, default=16)
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("serve-rollout", help="OpenAI-compatible server over postrl's rollout engine")
    p.add_argument("--model", required=True, help="a Hugging Face model folder, or 'demo'")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--backend", default="auto", choices=["auto", "native", "hf"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--served-model-name")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_serve_rollout)

    p = sub.add_parser("route", help="spread requests over rollout servers (least outstanding requests)")
    p.add_argument("--backend", action="append", required=True, help="a rollout server URL; repeat for more")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.set_defaults(func=_cmd_route)

    p = sub.add_parser("serve-reward", help="the Reward Service over HTTP (POST /score, /health, /metrics)")
    p.add_argument("--config", required=True, help="YAML with a 'reward' section and an optional 'server' section")
    p.add_argument("--host", default=None, help="bind address (default server.host, loopback)")
    p.add_argument("--port", type=int, default=None, help="port (default server.port)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. reward.num_workers=4")
    p.set_defaults(func=_cmd_serve_reward)

    p = sub.add_parser("convert-gguf", help="write a Hugging Face folder (safetensors, tokenizer) from a GGUF file")
    p.add_argument("file")
    p.add_argument("out_dir")
    p.set_defaults(func=_cmd_convert_gguf)
    return parser


def _quiet_transformers() -> None:
    """transformers' per-file progress bars drown the step lines; warnings and errors still show."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _quiet_transformers()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from postrl.data import DatasetError
    from postrl.controller import RewardFailureError
    from postrl.reward.client import RewardServiceError
    from postrl.train.worker import NonFiniteLossError

    try:
        return args.func(args)
    except (ConfigError, DatasetError, FileNotFoundError, NonFiniteLossError, RewardFailureError, RewardServiceError) as exc:
        print(f"postrl {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
