"""Multi-turn agentic RL: learning to use a tool, token exactness on a real model, KV reuse across turns.

Parts (all by default):
  learn   The ``calculator`` task (3-digit x 2-digit products, a calculator tool) from the shipped
          warm-started char model (``agentic-demo``, made by scripts/build_agentic_model.py): held-out success
          before and after GRPO on the environment's reward, the wall time of the training run
          (at most --learn-minutes), the mean turns per held-out episode.
  exact   SmolLM2-135M-Instruct with its own chat template: 200 episodes of >= 3 turns whose
          environment answers every turn with a tool message (a turn ends at the model's end of turn
          or after 48 tokens, and goes to the environment either way: on_turn_length=continue). Every engine call is recorded; an
          assembled trajectory that is not exactly the engine's prompt + response of each of its
          turns is a mismatch. The trainer's fp32 logprobs of the assembled trajectories against
          the engine's (fp32). Also how many trajectories naive re-tokenization (decode, then encode
          the text) would have changed.
  latency 64 episodes of a tool task whose tool answers each call after a random 50-500 ms (a
          remote sandbox; the delays drawn per episode and call from the seed, the same in both
          runs): episodes per minute with episodes scheduled individually (each turn to the
          engine as soon as its tool answers) against lockstep turns (every turn waits for all).
          Then GRPO on the calculator task with the same 50-500 ms calculator, sync against async
          (overlap=generation, max_staleness 1) for --async-steps steps: the training wall time and
          held-out success after each (--latency-train 0 skips it)
  frameworks  SmolLM2-135M-Instruct (fp32) driven by the agent frameworks of examples/agents (the
          OpenAI Agents SDK on the Responses API, LangGraph's ReAct agent on chat completions with
          tools=), each pointed at postrl's recording server by its base URL, on the tool-arithmetic
          prompts: episodes and tool calls recorded; every trajectory exactly the prompt + response
          of each of its engine calls (retokenization_mismatches), and the trainer's fp32 logprobs
          of the recorded trajectories against the engine's (max_logprob_diff).
  speed   64 concurrent 4-turn episodes (SmolLM2, fp32), each on a document of its own (30 lines,
          ~270 tokens) with short tool outputs and 16-token turns: generated tokens/s with the K/V
          kept across turns against prefilling each turn's whole context again.

    python benchmarks/agentic.py [--part learn|exact|latency|speed|all] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _engine_calls import exactly_engine_calls, log_calls
from _smoke import add_smoke

from postrl.models.loading import AGENTIC_MODEL_DIR

ROOT = Path(__file__).resolve().parents[1]
OBSERVATION = "total 48\n" + "".join(
    f"-rw-r--r-- 1 user user {1000 + 37 * i} Nov {i + 1} file_{i}.txt\n" for i in range(6)
)


class ToolReplies:
    """Answers every turn with a tool message until turn ``turns``, then ends the episode (reward 1)."""

    def __init__(self, turns: int = 3, text: str = "ok") -> None:
        from postrl.rollout.agentic.tools import Tool

        self.tools: list[Tool] = []
        self.turns, self.text, self.seen = turns, text, 0

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action: str):
        from postrl.rollout.agentic.env import StepResult

        self.seen += 1
        if self.seen >= self.turns:
            return StepResult([], reward=1.0, done=True)
        return StepResult([{"role": "tool", "content": self.text}])

    def close(self) -> None:
        pass


class SlowCalculator:
    """The calculator task's environment with its tool behind a remote sandbox: each call answers
    after a delay drawn from the episode's problem (``agent.env=agentic:SlowCalculator``)."""

    def __init__(self, low_s: float = 0.05, high_s: float = 0.5) -> None:
        import random

        from postrl.rollout.agentic.builtin_tools import calculator
        from postrl.rollout.agentic.env import ToolEnvironment
        from postrl.rollout.agentic.tools import Tool

        self.rng = random.Random()

        def remote_calculator(expression: str) -> str:
            """Evaluate an arithmetic expression exactly (integers stay integers).

            Args:
                expression: numbers with + - * / // % ** and parentheses, e.g. "123 * (45 + 6)"
            """
            time.sleep(self.rng.uniform(low_s, high_s))
            return calculator(expression)

        self.env = ToolEnvironment([Tool.from_function(remote_calculator, "calculator")])
        self.tools = self.env.tools

    def reset(self, row):
        self.rng.seed(str(row.get("answer")))
        return self.env.reset(row)

    def step(self, action: str):
        return self.env.step(action)

    def state_dict(self):
        return self.env.state_dict()

    def load_state_dict(self, state) -> None:
        self.env.load_state_dict(state)

    def close(self) -> None:
        self.env.close()


class SlowTool(ToolReplies):
    """ToolReplies whose tool answers each call after a delay drawn from the episode's seed."""

    def __init__(self, turns: int, low_s: float, high_s: float, seed: int) -> None:
        super().__init__(turns, "ok")
        self.low_s, self.high_s, self.seed = low_s, high_s, seed
        self.delays: list[float] = []

    def reset(self, row):
        import random

        rng = random.Random(self.seed * 1_000_003 + int(row["episode"]))
        self.delays = [rng.uniform(self.low_s, self.high_s) for _ in range(self.turns)]
        return super().reset(row)

    def step(self, action: str):
        if self.seen + 1 < self.turns:  # a tool call (the last turn is the answer: no tool)
            time.sleep(self.delays[self.seen])
        return super().step(action)


def smollm2_unavailable() -> str | None:
    """Why SmolLM2-135M-Instruct cannot be loaded here (None: it can)."""
    try:
        from postrl.models.gguf import smollm2_gguf_path

        smollm2_gguf_path()
        import gguf  # noqa: F401
    except (ImportError, FileNotFoundError, ValueError) as exc:
        return f"{exc} (and postrl[gguf] to convert it)"
    return None


def smollm2():
    from postrl.models.gguf import smollm2_dir
    from postrl.models.loading import load_causal_lm, load_tokenizer

    folder = str(smollm2_dir())
    return load_causal_lm(folder).float().eval(), load_tokenizer(folder)


def prompts(tokenizer, n: int, start: int = 0, document_lines: int = 0):
    """n different user prompts; with ``document_lines``, each carries a document of its own (the
    task an agent works on: a file, an issue), ~9 tokens a line."""
    from postrl.types import Prompt

    topics = ["the files in this folder", "disk usage", "the largest file", "recent changes", "the log", "the tests"]
    out = []
    for i in range(start, start + n):
        document = "".join(f"line {k}: item {(i * 7919 + k * 104729) % 100000}\n" for k in range(document_lines))
        out.append(Prompt(f"{document}Tell me about {topics[i % len(topics)]} ({i}).", [], messages=None))
    return out


def exact(args: argparse.Namespace) -> dict:
    from postrl.rollout.agentic.episodes import EpisodeLimits, EpisodeRunner
    from postrl.rollout.native import NativeRolloutWorker
    from postrl.types import SamplingParams

    model, tokenizer = smollm2()
    engine = NativeRolloutWorker.from_hf(model, tokenizer, torch.float32, seed=0)
    calls: list[tuple[list[int], list[int]]] = []

    def generate(ps, sp):
        out = engine.generate(ps, sp, None)
        calls.extend((list(r.prompt_ids), list(r.response_ids)) for r in out)
        return out

    limits = EpisodeLimits(3, args.exact_turn_tokens, 1024, end_on_turn_length=False)  # every episode has 3 turns
    runner = EpisodeRunner(generate, lambda: ToolReplies(3, "56088"), tokenizer, limits)
    began = time.perf_counter()
    rollouts = runner.run(prompts(tokenizer, args.episodes), SamplingParams(n=1, temperature=1.0, seed=0))
    took = time.perf_counter() - began
    runner.close()
    mismatches = naive = 0
    for r in rollouts:
        full = r.prompt_ids + r.response_ids
        mine = [(p, g) for p, g in calls if p[: len(r.prompt_ids)] == r.prompt_ids]
        turns = [(p, g) for p, g in mine if full[: len(p) + len(g)] == p + g]
        if len(turns) != len(r.episode.turns) or len(mine) != len(r.episode.turns):
            mismatches += 1
        if tokenizer(tokenizer.decode(full), add_special_tokens=False)["input_ids"] != full:
            naive += 1
    diff = 0.0
    with torch.no_grad():
        for r in rollouts:
            ids = torch.tensor([r.prompt_ids + r.response_ids])
            logits = model(ids).logits[0, len(r.prompt_ids) - 1 : -1].float()
            mine = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.response_ids).unsqueeze(1)).squeeze(1)
            mask = torch.tensor(r.loss_mask, dtype=torch.bool)
            diff = max(diff, float((mine - torch.tensor(r.logprobs))[mask].abs().max()))
    return {
        "episodes": len(rollouts),
        "turns_min": min(len(r.episode.turns) for r in rollouts),
        "tool_messages_min": min(sum(m["role"] == "tool" for m in r.episode.messages) for r in rollouts),
        "retokenization_mismatches": mismatches,
        "naive_retokenization_changed": naive,
        "max_logprob_diff": diff,
        "exact_s": round(took, 1),
    }


def latency(args: argparse.Namespace) -> dict:
    from postrl.models.loading import load_causal_lm, load_tokenizer
    from postrl.rollout.agentic.episodes import EpisodeLimits, EpisodeRunner
    from postrl.rollout.agentic.individual import Individual
    from postrl.rollout.agentic.lockstep import Lockstep
    from postrl.rollout.native import NativeRolloutWorker
    from postrl.types import Prompt, SamplingParams

    model_dir = str(Path(args.model) if args.model else AGENTIC_MODEL_DIR)
    model, tokenizer = load_causal_lm(model_dir).float().eval(), load_tokenizer(model_dir)
    low, high = args.tool_latency_ms[0] / 1000, args.tool_latency_ms[1] / 1000
    limits = EpisodeLimits(
        args.latency_turns, args.turn_tokens, 2048, end_on_turn_length=False, env_workers=args.env_workers
    )
    episodes = [
        Prompt(f"What is {100 + 7 * i} * {10 + i % 90}?", [], columns={"episode": i}, messages=None)
        for i in range(args.latency_episodes)
    ]
    walls: dict[str, list[float]] = {"lockstep": [], "individual": []}
    turns: dict[str, int] = {}
    for repeat in range(args.latency_repeats):  # alternating, so both see the machine's same moods
        for mode in ("lockstep", "individual"):
            engine = NativeRolloutWorker.from_hf(model, tokenizer, torch.float32, seed=args.seed)
            runner = EpisodeRunner(
                lambda ps, sp, engine=engine: engine.generate(ps, sp, None),
                lambda: SlowTool(args.latency_turns, low, high, args.seed),
                tokenizer,
                limits,
                schedule=Individual(joins_calls=True) if mode == "individual" else Lockstep(),
            )
            began = time.perf_counter()
            rollouts = runner.run(episodes, SamplingParams(n=1, temperature=1.0, seed=args.seed))
            took = time.perf_counter() - began
            walls[mode].append(took)
            turns[mode] = sum(len(r.episode.turns) for r in rollouts if r.episode is not None)
            generated = sum(sum(r.loss_mask) for r in rollouts)
            print(
                f"  {repeat + 1}. {mode:10s} {len(rollouts) / took * 60:7.1f} episodes/min  {took:5.2f} s  "
                f"{turns[mode]} turns  {generated} generated tokens",
                file=sys.stderr,
            )
    n, wall = len(episodes), {mode: statistics.median(w) for mode, w in walls.items()}
    result = {
        "episode_throughput_ratio": round(wall["lockstep"] / wall["individual"], 3),
        "episodes_per_min_individual": round(n / wall["individual"] * 60, 1),
        "episodes_per_min_lockstep": round(n / wall["lockstep"] * 60, 1),
        "episode_throughput_ratios": [round(a / b, 3) for a, b in zip(walls["lockstep"], walls["individual"])],
        "latency_turns": turns["individual"],
        "latency_turns_lockstep": turns["lockstep"],
    }
    if args.async_steps:
        result.update(async_training(args))
    return result


def async_training(args: argparse.Namespace) -> dict:
    """Sync against async GRPO on the calculator task whose tool answers after 50-500 ms."""
    model_dir = Path(args.model) if args.model else AGENTIC_MODEL_DIR
    from postrl.config.loading import load_config
    from postrl.controller.env_episodes import EnvEpisodes
    from postrl.data.prompt_source import prompt_source
    from postrl.models.loading import load_causal_lm, load_tokenizer
    from postrl.rollout.native import NativeRolloutWorker
    from postrl.run.resolve import resolved_run
    from postrl.run.train_runner import train
    from postrl.run.validation import Validator, load_validation_set

    out: dict[str, float] = {}
    for mode in ("sync", "async"):
        overrides = [
            f"model.path={model_dir}", f"output_dir={Path(args.cache) / 'runs'}", f"name=latency-{mode}",
            f"steps={args.async_steps}", f"seed={args.seed}", "agent.env=agentic:SlowCalculator",
            "agent.scheduling=individual", f"agent.env_workers={args.env_workers}", f"controller.mode={mode}",
            "logging.eval_every=0", "checkpoint.every_steps=0", *args.override,
        ]  # fmt: skip
        if mode == "async":
            overrides += ["controller.overlap=generation", "buffer.max_staleness=1"]
        config = resolved_run(load_config(str(ROOT / "examples" / "calculator_agent.yaml"), overrides))
        began = time.perf_counter()
        train(config, overwrite=True)
        out[f"{mode}_wall_s"] = round(time.perf_counter() - began, 1)
        instant = [o for o in overrides if not o.startswith("agent.env=")] + ["agent.env=calculator"]
        held_out = resolved_run(load_config(str(ROOT / "examples" / "calculator_agent.yaml"), instant))
        tokenizer = load_tokenizer(str(model_dir))
        validator = Validator(held_out, load_validation_set(held_out, prompt_source(held_out.data, tokenizer)))
        engine = NativeRolloutWorker.from_hf(load_causal_lm(str(config.run_dir / "final_model")), tokenizer)
        episodes = EnvEpisodes(held_out.agent, tokenizer, engine, None)  # type: ignore[arg-type] # the env scores
        out[f"acc_{mode}"] = validator.run(episodes, None)["val/accuracy"]
        print(f"  {mode:6s} {args.async_steps} steps in {out[f'{mode}_wall_s']} s, held-out {out[f'acc_{mode}']:.3f}",
              file=sys.stderr)  # fmt: skip
    return {
        "async_wall_ratio": round(out["async_wall_s"] / out["sync_wall_s"], 3),
        "acc_sync": out["acc_sync"],
        "acc_async": out["acc_async"],
        "sync_wall_s": out["sync_wall_s"],
        "async_wall_s": out["async_wall_s"],
    }


def frameworks(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(ROOT / "examples" / "agents"))
    import frameworks as examples  # examples/agents/frameworks.py

    from postrl.rollout.agentic.agent_function import RecordedAgents
    from postrl.rollout.native import NativeRolloutWorker
    from postrl.serve.recording_server import RecordingServer
    from postrl.types import Prompt, SamplingParams

    model, tokenizer = smollm2()
    rows = [
        json.loads(line) for line in (ROOT / "examples" / "data" / "tool_arithmetic.jsonl").read_text().splitlines()
    ]
    prompts = [Prompt(r["prompt"], [], columns=r) for r in rows[: args.framework_episodes]]
    result: dict = {}
    for name in ("agents_sdk", "langgraph_react"):
        engine = NativeRolloutWorker.from_hf(model, tokenizer, torch.float32, seed=args.seed)
        calls = log_calls(engine)
        server = RecordingServer.of_engine(engine, tokenizer, tools_in_prompt="system")
        agents = RecordedAgents(server, getattr(examples, name), 8, 600.0)
        began = time.perf_counter()
        try:
            rollouts = agents.run(prompts, SamplingParams(n=1, temperature=1.0, max_tokens=examples.MAX_TOKENS))
        finally:
            agents.close()
        took = time.perf_counter() - began
        recorded = [r for r in rollouts if r.response_ids]
        mismatches = sum(not exactly_engine_calls(r, calls) for r in recorded)
        tool_calls = sum(
            len(m.get("tool_calls") or [])
            for r in recorded
            if r.episode and r.episode.part == 0
            for m in r.episode.messages
        )
        result[name] = {
            "episodes": len({id(r.episode) for r in recorded}),
            "samples": len(recorded),
            "failed": sum(1 for r in rollouts if r.episode and "env_error" in r.episode.info),
            "model_calls": len(calls),
            "tool_calls": tool_calls,
            "retokenization_mismatches": mismatches,
            "max_logprob_diff": _max_logprob_diff(model, recorded),
            "seconds": round(took, 1),
        }
        print(f"  {name:16s} {result[name]}", file=sys.stderr)
    return {
        "frameworks": result,
        "retokenization_mismatches": sum(v["retokenization_mismatches"] for v in result.values()),
        "max_logprob_diff": max(v["max_logprob_diff"] for v in result.values()),
    }


def _max_logprob_diff(model, rollouts) -> float:
    diff = 0.0
    with torch.no_grad():
        for r in rollouts:
            ids = torch.tensor([r.prompt_ids + r.response_ids])
            logits = model(ids).logits[0, len(r.prompt_ids) - 1 : -1].float()
            mine = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r.response_ids).unsqueeze(1)).squeeze(1)
            mask = torch.tensor(r.loss_mask or [1] * len(r.response_ids), dtype=torch.bool)
            diff = max(diff, float((mine - torch.tensor(r.logprobs))[mask].abs().max()))
    return diff


def speed(args: argparse.Namespace) -> dict:
    from postrl.rollout.agentic.episodes import EpisodeLimits, EpisodeRunner
    from postrl.rollout.native import NativeRolloutWorker
    from postrl.types import SamplingParams

    model, tokenizer = smollm2()
    results = {}
    for mode, kept_mb in (("reprefill", 0), ("kv_reuse", 4096)):
        engine = NativeRolloutWorker.from_hf(model, tokenizer, torch.float32, seed=0, kept_cache_mb=kept_mb)
        runner = EpisodeRunner(
            lambda ps, sp, engine=engine: engine.generate(ps, sp, None),
            lambda: ToolReplies(5, OBSERVATION),
            tokenizer,
            EpisodeLimits(4, args.turn_tokens, 2048, end_on_turn_length=False),  # every episode has 4 turns
        )
        began = time.perf_counter()
        episodes = prompts(tokenizer, min(64, args.episodes), document_lines=args.document_lines)
        rollouts = runner.run(episodes, SamplingParams(n=1, temperature=1.0, seed=1))
        took = time.perf_counter() - began
        runner.close()
        generated = sum(sum(r.loss_mask) for r in rollouts)
        turns = min(len(r.episode.turns) for r in rollouts)
        results[mode] = (generated / took, took, engine.stats["prefill_tokens"], turns, engine.kept.hits)
        print(
            f"  {mode:10s} {generated / took:7.1f} generated tok/s {took:6.1f} s, prefilled {engine.stats['prefill_tokens']}",
            file=sys.stderr,
        )
    return {
        "multi_turn_speedup": round(results["kv_reuse"][0] / results["reprefill"][0], 3),
        "tokens_per_s_kv_reuse": round(results["kv_reuse"][0], 1),
        "tokens_per_s_reprefill": round(results["reprefill"][0], 1),
        "prefill_tokens_kv_reuse": results["kv_reuse"][2],
        "prefill_tokens_reprefill": results["reprefill"][2],
        "kept_kv_hits": results["kv_reuse"][4],
        "speed_turns_min": min(v[3] for v in results.values()),
    }


def learn(args: argparse.Namespace) -> dict:
    model_dir = Path(args.model) if args.model else AGENTIC_MODEL_DIR  # the shipped warm start (agentic-demo)
    from postrl.config.loading import load_config
    from postrl.controller.env_episodes import EnvEpisodes
    from postrl.data.prompt_source import prompt_source
    from postrl.models.loading import load_causal_lm, load_tokenizer
    from postrl.rollout.native import NativeRolloutWorker
    from postrl.run.resolve import resolved_run
    from postrl.run.train_runner import train
    from postrl.run.validation import Validator, load_validation_set

    out = Path(args.cache) / "runs"
    overrides = [
        f"model.path={model_dir}", f"output_dir={out}", "name=calculator", f"steps={args.learn_steps}",
        f"seed={args.seed}", *args.override,
    ]  # fmt: skip
    config = load_config(str(ROOT / "examples" / "calculator_agent.yaml"), overrides)
    config = resolved_run(config)
    tokenizer = load_tokenizer(str(model_dir))
    validator = Validator(config, load_validation_set(config, prompt_source(config.data, tokenizer)))

    def held_out(path: str) -> dict[str, float]:
        engine = NativeRolloutWorker.from_hf(load_causal_lm(path), tokenizer, torch.float32)
        episodes = EnvEpisodes(config.agent, tokenizer, engine, None)  # type: ignore[arg-type] # the env scores
        return validator.run(episodes, None)

    before = held_out(str(model_dir))
    began = time.perf_counter()
    train(config, overwrite=True)
    wall = time.perf_counter() - began
    after = held_out(str(config.run_dir / "final_model"))
    rows = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "acc_before": before["val/accuracy"],
        "acc_after": after["val/accuracy"],
        "wall_s": round(wall, 1),
        "steps_run": len(rows),
        "mean_turns": after["val/agent/turns_mean"],
        "mean_turns_before": before["val/agent/turns_mean"],
        "tool_errors_after": after["val/agent/tool_errors"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["learn", "exact", "latency", "frameworks", "speed", "all"], default="all")
    parser.add_argument("--frameworks", action="store_true", help="the frameworks part only")
    parser.add_argument("--framework-episodes", type=int, default=24, help="frameworks: episodes per framework")
    parser.add_argument("--latency", action="store_true", help="the latency part only (same as --part latency)")
    parser.add_argument("--latency-episodes", type=int, default=64)
    parser.add_argument("--latency-turns", type=int, default=4, help="latency: model turns per episode")
    parser.add_argument("--latency-repeats", type=int, default=5, help="latency: runs of each mode (the median counts)")
    parser.add_argument("--tool-latency-ms", type=float, nargs=2, default=[50.0, 500.0])
    parser.add_argument("--env-workers", type=int, default=32, help="latency: environment calls at once")
    parser.add_argument("--async-steps", type=int, default=30, help="latency: GRPO steps of sync and async (0: none)")
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--turn-tokens", type=int, default=16)
    parser.add_argument("--exact-turn-tokens", type=int, default=48)
    parser.add_argument("--document-lines", type=int, default=30, help="speed: lines of each episode's own document")
    parser.add_argument("--learn-steps", type=int, default=80)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--override", action="append", default=[], help="a config override for the learn run (k=v)")
    parser.add_argument(
        "--model", default=None, help="learn: the warm-started model (default: the shipped agentic-demo)"
    )
    parser.add_argument("--cache", default=str(ROOT / "benchmarks" / ".cache"))
    parser.add_argument("--json", action="store_true")
    add_smoke(parser)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result: dict = {}
    smollm2_missing = smollm2_unavailable() if args.smoke else None
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:  # 2 RL steps, a few episodes
            args.cache, args.episodes, args.learn_steps, args.latency_episodes, args.async_steps = tmp, 4, 2, 4, 2
            args.latency_repeats, args.framework_episodes, args.document_lines = 1, 2, 4
            args.override += ["prompts_per_step=2", "rollout.n=2", "data.val_size=4", "train.mini_batch_size=4",
                              "train.micro_batch_size=4"]  # fmt: skip
        if args.latency or args.frameworks:
            args.part = "latency" if args.latency else "frameworks"
        parts = (("learn", learn), ("exact", exact), ("latency", latency), ("frameworks", frameworks), ("speed", speed))
        for part, fn in parts:
            if args.part not in (part, "all"):
                continue
            if part in ("exact", "frameworks", "speed") and smollm2_missing:
                print(f"skipped part {part}: {smollm2_missing}")
                result[f"{part}_skipped"] = smollm2_missing
                continue
            result.update(fn(args))
    print(f"{'metric':32s} value")
    for key, value in result.items():
        print(f"{key:32s} {value}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
