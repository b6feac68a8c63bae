"""The ``postrl`` command line: train, demo, eval, servers and conversion."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from typing import TypeVar

from postrl.config.run import ConfigError

ConfigT = TypeVar("ConfigT")


def _run_config(args: argparse.Namespace, model: type[ConfigT], extra: list[str]) -> ConfigT:
    """A new run's config (CONFIG + overrides) or, with --resume, the run's saved one (+ overrides)."""
    from postrl.config.run import load_config
    from postrl.run.place import resume_config

    if args.resume:
        if args.config and "=" not in args.config:
            raise ConfigError("give either CONFIG or --resume RUN_DIR, not both")
        if args.overwrite:
            raise ConfigError("--overwrite starts a new run; it cannot be combined with --resume")
        return resume_config(
            args.resume,
            ([args.config] if args.config else []) + args.overrides + extra,
            model,
            force_change=args.force_change,
        )
    if args.force_change:
        raise ConfigError("--force-change is for --resume (a new run may set any field)")
    if not args.config:
        raise ConfigError(f"postrl {args.command} needs a CONFIG.yaml (or --resume runs/NAME)")
    return load_config(args.config, args.overrides + extra, model=model)


def _cmd_train(args: argparse.Namespace) -> int:
    from postrl.config.run import RunConfig
    from postrl.run.train_runner import train

    config = _run_config(args, RunConfig, _ray_overrides(args))
    controller = train(config, resume=bool(args.resume), overwrite=args.overwrite)
    print(f"finished {controller.step_count} steps; run directory: {config.run_dir}")
    return 0


def _ray_overrides(args: argparse.Namespace) -> list[str]:
    """``--ray-address ADDR`` is ``scheduler.type=ray scheduler.address=ADDR`` (``local``: a Ray instance
    started for the run)."""
    if args.ray_address is None:
        return []
    address = "null" if args.ray_address == "local" else args.ray_address
    return ["scheduler.type=ray", f"scheduler.address={address}"]


def _cmd_dpo(args: argparse.Namespace) -> int:
    from postrl.config.dpo import DPORunConfig
    from postrl.run.dpo_runner import train_dpo

    config = _run_config(args, DPORunConfig, [])
    train_dpo(config, resume=bool(args.resume), overwrite=args.overwrite)
    print(f"run directory: {config.run_dir}")
    return 0


def _cmd_sft(args: argparse.Namespace) -> int:
    from postrl.config.sft import SFTRunConfig
    from postrl.run.sft_runner import train_sft

    config = _run_config(args, SFTRunConfig, _ray_overrides(args))
    steps = train_sft(config, resume=bool(args.resume), overwrite=args.overwrite)
    print(f"finished {steps} steps; run directory: {config.run_url or config.run_dir}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from postrl.run.demo import run_demo

    result = run_demo(args.overrides)
    print(
        f"demo done in {result.wall_s:.0f}s: held-out accuracy {result.acc_before:.3f} -> {result.acc_after:.3f} "
        f"after {result.steps} GRPO steps ({result.run_dir})"
    )
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from postrl.run.evaluate import run_eval

    return run_eval(
        model=args.model,
        run=args.run,
        task=args.task,
        data=args.data,
        config=args.config,
        max_tokens=args.max_tokens,
        out=args.out,
    )


def _cmd_serve_rollout(args: argparse.Namespace) -> int:
    from postrl.config.run import RolloutConfig
    from postrl.models.loading import load_causal_lm, load_tokenizer
    from postrl.rollout.factory import rollout_worker_for_model
    from postrl.serve.batcher import EngineBatcher
    from postrl.serve.openai_server import ServerLimits, build_app
    from postrl.serve.run import serve_app
    from postrl.workers.http_guard import is_loopback, read_token

    try:
        token = read_token(args.token_env)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if not is_loopback(args.host) and token is None:
        raise ConfigError(
            f"--host {args.host} is not loopback: anyone who reaches the port could generate"
            + (" and replace the model through /update_weights" if args.weights_dir else "")
            + "; set --token-env VAR (a bearer token in that environment variable)"
        )
    if args.weights_dir and not os.path.isdir(args.weights_dir):
        raise ConfigError(f"--weights-dir {args.weights_dir} is not a folder")
    tokenizer = load_tokenizer(args.model)
    model = load_causal_lm(args.model)
    rollout = RolloutConfig(backend=args.backend, dtype=args.dtype, max_batch_size=args.max_batch_size)
    worker = rollout_worker_for_model(rollout, model, tokenizer, "float32", seed=args.seed)
    batcher = EngineBatcher(worker)
    name = args.served_model_name or args.model
    max_context = getattr(model.config, "max_position_embeddings", None)
    limits = ServerLimits(
        max_n=args.max_n,
        max_tokens=args.max_tokens_limit,
        max_prompts=args.max_prompts,
        default_max_tokens=args.default_max_tokens,
        weights_dir=args.weights_dir,
        max_body_bytes=args.max_body_bytes,
    )
    app = build_app(batcher, tokenizer, name, max_context=max_context, limits=limits, token=token)
    engine = type(worker).__name__
    banner = (
        f"serving {name} ({engine}, context {max_context}) at http://{args.host}:{args.port}/v1"
        f"{'; bearer token required' if token else ''}"
        f"{f'; /update_weights reads {args.weights_dir}' if args.weights_dir else '; /update_weights disabled'}"
    )
    try:
        serve_app(app, args.host, args.port, banner)
    finally:
        batcher.close()
    return 0


def _cmd_route(args: argparse.Namespace) -> int:
    from postrl.serve.router import LeastOutstandingRouter, build_router_app
    from postrl.serve.run import serve_app
    from postrl.workers.http_guard import read_token

    try:
        token = read_token(args.token_env)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    router = LeastOutstandingRouter(args.backend, health_interval_s=args.health_interval_s, token=token)
    banner = f"routing http://{args.host}:{args.port}/v1 over {', '.join(router.backends)}"
    serve_app(build_router_app(router), args.host, args.port, banner)
    return 0


def _cmd_serve_reward(args: argparse.Namespace) -> int:
    from postrl.config.run import RewardServiceFile, activate_import_paths, load_config
    from postrl.reward.server import build_reward_app
    from postrl.reward.service import RewardService
    from postrl.serve.run import serve_app
    from postrl.workers.http_guard import is_loopback, read_token

    if not args.config:
        raise ConfigError("postrl serve-reward needs --config reward.yaml (sections: reward, server)")
    cfg = load_config(args.config, args.overrides, model=RewardServiceFile)
    server = cfg.server.model_copy(
        update={k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    )
    try:
        token = read_token(server.token_env, "server.token_env")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if not is_loopback(server.host) and token is None:
        print(f"warning: serving rewards on {server.host} without a token (set server.token_env)", file=sys.stderr)
    activate_import_paths(cfg.import_paths)
    service = RewardService(cfg.reward)
    service.set_log_stream(sys.stderr.buffer)
    if service.sandbox_protections is not None:
        on = [k for k, v in service.sandbox_protections.items() if v]
        off = [k for k, v in service.sandbox_protections.items() if not v]
        print(f"code sandbox protections active: {', '.join(on)}" + (f"; MISSING: {', '.join(off)}" if off else ""))
    names = ", ".join(f"{c.name} ({c.type}, weight {c.weight:g})" for c in service.components)
    try:
        # keep-alive longer than uvicorn's 5 s default: a pooled client connection closed by the
        # server just as the client reuses it surfaces as a ReadError on the client
        serve_app(
            build_reward_app(service, server, token),
            server.host,
            server.port,
            f"reward service on http://{server.host}:{server.port} with {names}",
            timeout_keep_alive=75,
        )
    finally:
        service.close()
    return 0


def _cmd_convert_gguf(args: argparse.Namespace) -> int:
    from postrl.models.gguf import convert_gguf

    print(f"wrote {convert_gguf(args.file, args.out_dir)}")
    return 0


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows every option's default; keeps the epilogs' line breaks."""


def _verbose_flag() -> argparse.ArgumentParser:
    """-v/--verbose, accepted before or after the subcommand."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="log at INFO level (default: warnings only)",
    )
    return parent


def _add_train(command: Callable[..., argparse.ArgumentParser]) -> None:
    p = command(
        "train",
        "run GRPO/PPO from a YAML config",
        epilog="The run directory is OUTPUT_DIR/NAME (config fields output_dir, default 'runs', and name, "
        "default 'run'): it receives config.yaml, metrics.jsonl, tensorboard/, samples/, checkpoints/, "
        "reward_workers.log, final_model/ and reward_accuracy.png. A new run refuses a directory that "
        "already holds one.\nCtrl-C (or SIGTERM) stops after the current step and checkpoints it; a second "
        "Ctrl-C abandons the step.\n\nexamples:\n  postrl train examples/arithmetic_grpo.yaml train.lr=5e-5 "
        "steps=20\n  postrl train --resume runs/arithmetic-grpo steps=40",
    )
    _add_run_arguments(p, "CONFIG.yaml (see src/postrl/config/run.py for every field)", "train.lr=1e-5 name=try2")
    _add_ray_address(p)
    p.set_defaults(func=_cmd_train)


def _add_ray_address(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="run the workers as Ray actors on the cluster at ADDR (host:port or ray://...); 'local' "
        "starts a Ray instance for the run and shuts it down at the end (same as scheduler: ray)",
    )


def _add_run_arguments(p: argparse.ArgumentParser, config_help: str, override_example: str) -> None:
    """CONFIG, overrides, --resume and --overwrite: the same for every command that starts a run."""
    p.add_argument("config", nargs="?", help=config_help)
    p.add_argument("overrides", nargs="*", help=f"dotted key=value overrides, e.g. {override_example}")
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue runs/NAME from its latest checkpoint; overrides "
        "may lengthen it and change logging, checkpoints, workers and timeouts",
    )
    p.add_argument(
        "--force-change",
        metavar="FIELD",
        action="append",
        default=[],
        help="with --resume: allow an override of a field that defines the run (model, data, algorithm, "
        "seed, ...), e.g. --force-change train.lr; repeat for more",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start anew in a run directory that holds a run, moving the old run to NAME.old-<time> (never deleted)",
    )


def _add_dpo(command: Callable[..., argparse.ArgumentParser]) -> None:
    p = command(
        "dpo",
        "train offline on preference pairs (DPO, IPO, cDPO) from a YAML config",
        epilog="Pairs: JSONL/Parquet rows with prompt, chosen, rejected strings, or chosen/rejected chat "
        "message lists (see src/postrl/config/dpo.py and docs/algorithms.md).\n\nexamples:\n"
        "  postrl dpo examples/dpo.yaml dpo.beta=0.2\n  postrl dpo --resume runs/dpo epochs=2",
    )
    _add_run_arguments(p, "CONFIG.yaml (sections: model, data, dpo, train, checkpoint, logging)", "dpo.loss_type=ipo")
    p.set_defaults(func=_cmd_dpo)


def _add_sft(command: Callable[..., argparse.ArgumentParser]) -> None:
    p = command(
        "sft",
        "supervised fine-tuning on prompt/response or chat rows (loss on the response or the assistant turns only)",
        epilog="Rows: JSONL/Parquet with prompt and response strings, or a messages chat list (see "
        "src/postrl/config/sft.py). The run directory, checkpoints, --resume, FSDP2 "
        "(scheduler.train.workers=2) and --ray-address work as in postrl train.\n\nexamples:\n"
        "  postrl sft examples/sft_format.yaml\n  postrl sft --resume runs/sft-format epochs=3",
    )
    _add_run_arguments(
        p, "CONFIG.yaml (sections: model, data, train, checkpoint, logging, scheduler)", "train.lr=5e-5 epochs=2"
    )
    _add_ray_address(p)
    p.set_defaults(func=_cmd_sft)


def _add_demo(command: Callable[..., argparse.ArgumentParser]) -> None:
    p = command("demo", "GRPO on the built-in arithmetic task with the shipped model (runs/demo, demo-2, ...)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. steps=20")
    p.set_defaults(func=_cmd_demo)


def _add_eval(command: Callable[..., argparse.ArgumentParser]) -> None:
    from postrl.tasks import TASKS

    p = command(
        "eval",
        "held-out accuracy of a model: a built-in task, or your own prompt file scored by a run's reward components",
        epilog="examples:\n  postrl eval --model runs/demo/final_model --task arithmetic\n"
        "  postrl eval --run runs/NAME --data heldout.jsonl --out scored.jsonl",
    )
    p.add_argument(
        "--model",
        help="a model folder (or 'demo'); default with --run: the run's final_model/ (else its newest checkpoint)",
    )
    p.add_argument("--run", help="a run directory: its model, and its reward and data settings for --data")
    p.add_argument(
        "--task",
        choices=sorted(TASKS),
        default=None,
        help="a built-in task: "
        + "; ".join(f"{t.name}: {t.description}" for t in TASKS.values())
        + " (default: the run's task, else arithmetic)",
    )
    p.add_argument(
        "--data",
        nargs="+",
        metavar="FILE",
        help="JSONL/Parquet prompt files to evaluate on (scored with the reward components of --run or --config)",
    )
    p.add_argument("--config", help="a train CONFIG.yaml whose reward section scores --data (instead of --run)")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="new tokens per response (default: the run's rollout.max_tokens, else 16)",
    )
    p.add_argument("--out", help="write every scored sample to this JSONL file")
    p.set_defaults(func=_cmd_eval)


def _add_serve_rollout(command: Callable[..., argparse.ArgumentParser]) -> None:
    p = command("serve-rollout", "OpenAI-compatible server over postrl's rollout engine")
    p.add_argument("--model", required=True, help="a Hugging Face model folder, or 'demo'")
    p.add_argument("--host", default="127.0.0.1", help="bind address; anything but loopback needs --token-env")
    p.add_argument("--port", type=int, default=8000, help="port")
    p.add_argument("--backend", default="auto", choices=["auto", "native", "hf"], help="rollout engine")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="engine dtype")
    p.add_argument("--max-batch-size", type=int, default=256, help="sequences decoded together")
    p.add_argument("--served-model-name", help="the model name clients send (default: --model)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of the engine")
    p.add_argument(
        "--token-env",
        help="environment variable holding a bearer token; when set every request "
        "needs 'Authorization: Bearer <token>'",
    )
    p.add_argument(
        "--weights-dir", help="the only folder /update_weights may read from (default: /update_weights is disabled)"
    )
    p.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger request bodies get 413")
    p.add_argument("--max-n", type=int, default=64, help="largest n (choices per prompt) a request may ask for")
    p.add_argument("--max-tokens-limit", type=int, default=4096, help="largest max_tokens a request may ask for")
    p.add_argument("--max-prompts", type=int, default=64, help="most prompts in one completions request")
    p.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens when a request gives none")
    p.set_defaults(func=_cmd_serve_rollout)


def _add_route(command: Callable[..., argparse.ArgumentParser]) -> None:
    p = command(
        "route",
        "spread requests over rollout servers (least outstanding requests; unhealthy backends leave the rotation)",
    )
    p.add_argument("--backend", action="append", required=True, help="a rollout server URL; repeat for more")
    p.add_argument("--host", default="127.0.0.1", help="bind address")
    p.add_argument("--port", type=int, default=8200, help="port (serve-rollout uses 8000, serve-reward 8100)")
    p.add_argument("--health-interval-s", type=float, default=5.0, help="seconds between health checks of the backends")
    p.add_argument("--token-env", help="environment variable holding the bearer token sent to the backends")
    p.set_defaults(func=_cmd_route)


def _add_serve_reward(command: Callable[..., argparse.ArgumentParser]) -> None:
    p = command("serve-reward", "the Reward Service over HTTP (POST /score, /health, /metrics)")
    p.add_argument("--config", required=True, help="YAML with a 'reward' section and an optional 'server' section")
    p.add_argument("--host", default=None, help="bind address (default: server.host, loopback)")
    p.add_argument("--port", type=int, default=None, help="port (default: server.port, 8100)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. reward.num_workers=4")
    p.set_defaults(func=_cmd_serve_reward)


def _add_convert_gguf(command: Callable[..., argparse.ArgumentParser]) -> None:
    p = command("convert-gguf", "write a Hugging Face folder (safetensors, tokenizer) from a GGUF file")
    p.add_argument("file", help="the .gguf file")
    p.add_argument("out_dir", help="the folder to write")
    p.set_defaults(func=_cmd_convert_gguf)


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("postrl")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    verbose = _verbose_flag()
    parser = argparse.ArgumentParser(
        prog="postrl", description="RL post-training of language models.", formatter_class=_Formatter, parents=[verbose]
    )
    parser.add_argument("--version", action="version", version=f"postrl {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, epilog: str | None = None) -> argparse.ArgumentParser:
        return sub.add_parser(
            name, help=help, description=help, epilog=epilog, formatter_class=_Formatter, parents=[verbose]
        )

    for add in (
        _add_train,
        _add_sft,
        _add_dpo,
        _add_demo,
        _add_eval,
        _add_serve_rollout,
        _add_route,
        _add_serve_reward,
        _add_convert_gguf,
    ):
        add(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides after an option (`train CONFIG --overwrite steps=2`) arrive here
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = list(args.overrides) + extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from postrl.models.loading import quiet_transformers

    quiet_transformers()
    verbose = getattr(args, "verbose", False)
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    from postrl.controller.controller import RewardFailureError
    from postrl.data import DatasetError
    from postrl.models.weights import WeightSyncError
    from postrl.reward.client import RewardServiceError
    from postrl.rollout.common import EngineUnhealthyError
    from postrl.rollout.pool import RolloutPoolError
    from postrl.run.interrupt import RunInterrupted
    from postrl.train.group import TrainWorkerDiedError
    from postrl.train.optimization import NonFiniteLossError
    from postrl.workers.handles import PlacementError

    try:
        return args.func(args)
    except RunInterrupted as exc:
        print(f"postrl {args.command}: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # before a run's own handler is installed (loading, validating): nothing written yet
        print(f"\npostrl {args.command}: interrupted", file=sys.stderr)
        return 130
    except (
        ConfigError,
        DatasetError,
        EngineUnhealthyError,
        FileNotFoundError,
        NonFiniteLossError,
        RewardFailureError,
        PlacementError,
        RewardServiceError,
        RolloutPoolError,
        TrainWorkerDiedError,
        WeightSyncError,
    ) as exc:
        print(f"postrl {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
