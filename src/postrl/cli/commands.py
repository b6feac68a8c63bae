"""The ``postrl`` commands, one function each: check the arguments, then run."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
from typing import TypeVar

from postrl.config.run import ConfigError

ConfigT = TypeVar("ConfigT")


def _run_config(args: argparse.Namespace, model: type[ConfigT], extra: list[str]) -> ConfigT:
    """A new run's config (CONFIG + overrides) or, with --resume, the run's saved one (+ overrides)."""
    from postrl.config.loading import load_config
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
    steps = train(config, resume=bool(args.resume), overwrite=args.overwrite).completed_steps
    print(f"finished {steps} steps; run directory: {config.run_dir}")
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


def _cmd_plan(args: argparse.Namespace) -> int:
    import json

    from postrl.config.loading import load_config
    from postrl.config.run import RunConfig
    from postrl.run.plan.check import target_for
    from postrl.run.plan.planner import make_plan
    from postrl.run.plan.render import render_plan

    if args.gpus is not None and args.gpus < 1:
        raise ConfigError(f"--gpus {args.gpus}: give at least 1")
    config = load_config(args.config, args.overrides, model=RunConfig)
    try:
        target = target_for(args.gpu, args.gpu_memory)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    gpus = args.gpus
    if gpus is None and not target.accelerator:  # one machine: as postrl train checks it (plan.check)
        gpus = max(1, config.scheduler.train.workers)
    plan = make_plan(config, target, gpus)
    print(json.dumps(plan.to_dict()) if args.json else render_plan(plan))
    return 0 if plan.fits else 1


def _cmd_report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from postrl.run.report import write_report

    default = (
        Path(args.runs[0]) / "report.png" if len(args.runs) == 1 and Path(args.runs[0]).is_dir() else Path("report.png")
    )
    out = write_report(args.runs, Path(args.out) if args.out else default)
    print(f"report: {out}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from postrl.run.evaluate import SampledEval, run_eval
    from postrl.run.progress import shown_on_console

    with shown_on_console():
        return run_eval(
            model=args.model,
            run=args.run,
            task=args.task,
            data=args.data,
            config=args.config,
            max_tokens=args.max_tokens,
            out=args.out,
            sampling=SampledEval(args.n, args.k, args.temperature, args.top_p, args.url, args.json),
        )


def _cmd_serve_rollout(args: argparse.Namespace) -> int:
    from postrl.config.rollout import RolloutConfig
    from postrl.models.host_memory import keep_freed_memory
    from postrl.models.loading import load_causal_lm, load_tokenizer
    from postrl.rollout.agentic.recorder import EpisodeRecorder
    from postrl.rollout.factory import rollout_worker_for_model
    from postrl.serve.batcher import EngineBatcher
    from postrl.serve.limits import ServerLimits
    from postrl.serve.openai_server import build_app
    from postrl.serve.run import serve_app

    keep_freed_memory()  # as a run's engine: each decode loop reuses the blocks the last one freed
    token = _serve_rollout_token(args)
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
    recorder = EpisodeRecorder(tokenizer, ids_from_callers=True) if args.record else None
    app = build_app(
        batcher,
        tokenizer,
        name,
        max_context=max_context,
        limits=limits,
        token=token,
        recorder=recorder,
        tool_format=args.tool_format,
        tools_in_prompt=args.tools_in_prompt,
    )
    engine = type(worker).__name__
    banner = (
        f"serving {name} ({engine}, context {max_context}) at http://{args.host}:{args.port}/v1"
        f"{'; bearer token required' if token else ''}"
        f"{f'; /update_weights reads {args.weights_dir}' if args.weights_dir else '; /update_weights disabled'}"
        f"{'; recording episodes (episode_id, X-Episode-Id or /episodes/ID/v1)' if recorder else ''}"
    )
    try:
        serve_app(app, args.host, args.port, banner)
    finally:
        batcher.close()
    return 0


def _serve_rollout_token(args: argparse.Namespace) -> str | None:
    """``serve-rollout``'s bearer token (from ``--token-env``); a server reachable beyond loopback
    must have one, and ``--weights-dir`` must be a folder."""
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
    return token


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
    from postrl.config.loading import load_config
    from postrl.config.run import RewardServiceFile, activate_import_paths
    from postrl.reward.server import build_reward_app
    from postrl.reward.service import LocalRewardService
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
    service = LocalRewardService(cfg.reward)
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
    from postrl.models.gguf import (
        GGUF_EXTRA,
        convert_gguf,
        gemma3_dir,
        gemma3_gguf_path,
        smollm2_dir,
        smollm2_gguf_path,
    )

    if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None:
        raise ConfigError(f"convert-gguf needs the gguf and accelerate packages: {GGUF_EXTRA}")
    named = {
        "smollm2": ("SmolLM2-135M-Instruct", smollm2_gguf_path, smollm2_dir),
        "gemma3": ("Gemma 3 270M", gemma3_gguf_path, gemma3_dir),
    }
    if args.file in named:
        title, gguf_path, cached_dir = named[args.file]
        source = gguf_path()  # FileNotFoundError: says how to install it
        print(f"{title}: {source}")
        out = cached_dir() if args.out_dir is None else convert_gguf(source, args.out_dir)
    elif args.out_dir is None:
        raise ConfigError(
            "convert-gguf FILE OUT_DIR: give the folder to write (only 'smollm2' and 'gemma3' have a default)"
        )
    else:
        out = convert_gguf(args.file, args.out_dir)
    print(f"wrote {out}")
    return 0


def _cmd_merge_lora(args: argparse.Namespace) -> int:
    from postrl.models.merge_adapter import merge_adapter

    if importlib.util.find_spec("peft") is None:
        raise ConfigError("merge-lora needs peft: pip install 'postrl[lora]'")
    print(f"wrote {merge_adapter(args.adapter, args.out_dir, args.base)}")
    return 0


def _cmd_check_template(args: argparse.Namespace) -> int:
    from postrl.models.loading import load_tokenizer
    from postrl.rollout.agentic.builtin_tools import BUILTIN_TOOLS
    from postrl.rollout.agentic.template_check import check_template
    from postrl.rollout.agentic.tools import Tool

    unknown = [t for t in args.tools if t not in BUILTIN_TOOLS]
    if unknown:
        raise ConfigError(f"--tools: unknown tool {unknown[0]!r} (built in: {', '.join(sorted(BUILTIN_TOOLS))})")
    model = args.model
    if model.endswith(".gguf"):
        from postrl.models.gguf import GGUF_EXTRA, convert_gguf

        if importlib.util.find_spec("gguf") is None:
            raise ConfigError(f"reading {model} needs the gguf package: {GGUF_EXTRA}")

        model = str(convert_gguf(model, tempfile.mkdtemp(prefix="postrl-gguf-")))
    tokenizer = load_tokenizer(model)
    if not tokenizer.chat_template:
        raise ConfigError(f"{args.model}: the tokenizer has no chat template")
    report = check_template(tokenizer, [Tool.from_function(BUILTIN_TOOLS[t], t).schema for t in args.tools] or None)
    for case in report.cases:
        print(case.line())
    print(report.tools_line())
    print(report.summary())
    return 0 if report.append_only and report.tools_rendered else 1


def _cmd_serve_env(args: argparse.Namespace) -> int:
    import json

    from postrl.config.run import activate_import_paths
    from postrl.rollout.agentic.env_lookup import environment_factory
    from postrl.serve.env_server import build_env_app
    from postrl.serve.run import serve_app
    from postrl.workers.http_guard import is_loopback, read_token

    try:
        options = json.loads(args.options)
        token = read_token(args.token_env)
    except (json.JSONDecodeError, ValueError) as exc:
        raise ConfigError(f"serve-env: {exc}") from None
    if not isinstance(options, dict):
        raise ConfigError("serve-env --options must be a JSON object")
    activate_import_paths([])
    try:
        make_env = environment_factory(args.env)
        make_env(**options).close()  # a bad environment or option fails here, before serving
    except (ValueError, TypeError) as exc:
        raise ConfigError(str(exc)) from None
    if not is_loopback(args.host) and token is None:
        print(f"warning: serving environments on {args.host} without a token (set --token-env)", file=sys.stderr)
    app = build_env_app(make_env, args.env, options, token, args.max_body_bytes)
    serve_app(app, args.host, args.port, f"environment {args.env} on http://{args.host}:{args.port}")
    return 0
