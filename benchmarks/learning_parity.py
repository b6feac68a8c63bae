"""Does postrl learn as much per step as TRL, on reasoning-gym tasks nobody tuned for?

SmolLM2-135M-Instruct trained with GRPO by postrl and by TRL's ``GRPOTrainer`` from the same
weights, on the same stream of prompts in the same order (one shuffle of the training problems per
seed, written to a file both read in file order: postrl with ``data.shuffle: false``, TRL with
``shuffle_dataset=False``), with the same hyperparameters (``PROMPTS`` x ``G`` samples, one
optimizer step per batch, lr ``LR`` constant, token-mean loss, group-std scaled rewards, no KL,
gradient clipping 1, AdamW 0.9/0.999/1e-8, bf16 autocast training) and the same precision: TRL
without vLLM samples with transformers ``generate`` on its float32 model, so postrl's engine runs in
float32 too (``--dtype``; a bf16 engine carries only a few percent of each update at these learning
rates, see ``docs/algorithms.md``), over ``--seeds`` seeds. Held-out greedy accuracy on problems
from another seed, disjoint from the training ones, is taken every ``--eval-every`` steps by
postrl's native engine in float32 for both (postrl's run validates itself on its engine; TRL's
model is evaluated from a callback). Each seed runs the two frameworks in
processes of their own with their steps interleaved (``_interleave``); TRL runs ``--steps`` steps,
postrl runs at least as many and on until its training wall time reaches TRL's (evaluation
excluded), for the equal-wall comparison.

The default task set is chosen by a rule, not by hand: of ``CANDIDATES`` (numeric-answer tasks,
none of them among ``real_task.py``'s), those whose base-model pass@8 on held-out problems lies in
0.2-0.6, the three nearest 0.4. ``--task NAME[:JSON]`` (repeatable) names the tasks instead;
``--task-set real_task`` takes ``real_task.py``'s three.

    python benchmarks/learning_parity.py [--task lcm --task 'gcd:{"max_value": 30}'] [--seeds 3]
        [--steps 8] [--minutes 20] [--png docs/learning_parity.png] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _figures import save
from _interleave import MARK, run_interleaved, turn, wait_for_turn
from _smoke import add_smoke, skip
from real_task import TASKS as REAL_TASK_TASKS
from real_task import accuracy_of, missing

CANDIDATES = [
    {"name": "lcm", "config": {"min_value": 2, "max_value": 12}},
    {"name": "leg_counting", "config": {"min_animals": 1, "max_animals": 2, "max_instances": 3}},
    {"name": "products", "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}},
    {"name": "count_bits", "config": {"max_n": 1000}},
    {"name": "letter_counting", "config": {"min_words": 3, "max_words": 5}},
    {"name": "simple_equations", "config": {"min_terms": 2, "max_terms": 2, "max_value": 20}},
    {
        "name": "decimal_chain_sum",
        "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "max_decimal_places": 1},
    },
    {"name": "count_primes", "config": {"max_n": 30}},
]
PASS_PROBLEMS, PASS_K, PASS_LOW, PASS_HIGH, CHOSEN = 24, 8, 0.2, 0.6, 3
PROMPTS, G, NEW_TOKENS, MICRO, LR = 8, 8, 48, 16, 1e-5
TRAIN_SIZE, VAL_PER_TASK = 400, 50
EVAL_DTYPE = "float32"  # held-out answers from the weights as trained, not a bf16 rounding of them
POSTRL_STEP_CAP = 8  # postrl runs at most this many times TRL's steps while catching up on wall time


def parse_task(spec: str) -> dict[str, Any]:
    """``NAME`` or ``NAME:{json config}``: a reasoning-gym task of ``data.reasoning_gym.tasks``."""
    name, _, config = spec.partition(":")
    try:
        parsed = json.loads(config) if config else {}
    except json.JSONDecodeError as exc:
        raise SystemExit(f"--task {spec!r}: the config after ':' is not JSON ({exc})") from exc
    if not isinstance(parsed, dict):
        raise SystemExit(f"--task {spec!r}: the config after ':' must be a JSON object")
    return {"name": name, "config": parsed}


def gym_config(tasks: list[dict], size: int, val_size: int) -> Any:
    from postrl.config.reasoning_gym import ReasoningGymConfig

    return ReasoningGymConfig.model_validate(
        {"tasks": tasks, "answer_format": "last_number", "size": size, "val_size": val_size, "seed": 0}
    )


def write_rows(path: Path, prompts: list) -> None:
    path.write_text("".join(json.dumps({"messages": p.messages, **p.columns}) + "\n" for p in prompts))


def prepare(tasks: list[dict], seed: int, folder: Path, smoke: bool) -> Path:
    """``train.jsonl`` (the training problems in this seed's order) and ``heldout.jsonl`` (problems
    from another seed, none of whose questions is a training one) under ``folder/seed-N``."""
    from postrl.data.reasoning_gym import build_gym_prompts, held_out, question_of
    from postrl.models.gguf import smollm2_dir
    from postrl.models.loading import load_tokenizer

    out = folder / f"seed-{seed}"
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(str(smollm2_dir()))
    gym = gym_config(tasks, 64 if smoke else TRAIN_SIZE, len(tasks) * (4 if smoke else VAL_PER_TASK))
    train = build_gym_prompts(gym, tokenizer, gym.seed, gym.size, 256).prompts
    random.Random(seed).shuffle(train)
    heldout, _ = held_out(gym, tokenizer, 256, {question_of(p.columns) for p in train})
    kept = {t["name"]: sum(p.task_type == t["name"] for p in heldout.prompts) for t in tasks}
    if not smoke and (few := {name: n for name, n in kept.items() if n < VAL_PER_TASK // 3}):
        raise SystemExit(
            f"held-out problems left after dropping training questions: {few} (of {VAL_PER_TASK} "
            "each): a task with so few distinct problems cannot be measured; widen its config"
        )
    write_rows(out / "train.jsonl", train)
    write_rows(out / "heldout.jsonl", heldout.prompts)
    return out


def choose_tasks(smoke: bool) -> tuple[list[dict], list[dict]]:
    """The rule: each candidate's base-model pass@8 on held-out problems (sampled at temperature 1
    by postrl's native engine); those in [PASS_LOW, PASS_HIGH], the ``CHOSEN`` nearest 0.4."""
    from postrl.config.run import RewardConfig, RolloutConfig
    from postrl.controller.source import SingleTurn
    from postrl.models.gguf import smollm2_dir
    from postrl.models.loading import load_causal_lm, load_tokenizer
    from postrl.reward.accuracy import is_correct
    from postrl.reward.factory import make_reward_service
    from postrl.rollout.factory import rollout_worker_for_model
    from postrl.types import SamplingParams

    candidates = CANDIDATES[:2] if smoke else CANDIDATES
    problems, k = (2, 2) if smoke else (PASS_PROBLEMS, PASS_K)
    tokenizer = load_tokenizer(str(smollm2_dir()))
    model = load_causal_lm(str(smollm2_dir()))
    engine = rollout_worker_for_model(RolloutConfig(dtype=EVAL_DTYPE), model, tokenizer, "float32", seed=0)
    reward = RewardConfig.model_validate({"components": [{"name": "correct", "type": "reasoning_gym"}]})
    service = make_reward_service(reward)
    rows = []
    try:
        source = SingleTurn(engine, service)
        for task in candidates:
            gym = gym_config([task], 1, problems)
            from postrl.data.reasoning_gym import held_out

            prompts = held_out(gym, tokenizer, 256, set())[0].prompts
            sampling = SamplingParams(n=k, temperature=1.0, max_tokens=8 if smoke else NEW_TOKENS)
            rollouts = source.generate(prompts, sampling, None)
            results = source.score(prompts, rollouts)
            solved = {
                r.prompt_index for r, res in zip(rollouts, results, strict=True) if is_correct(res, "correct", 1.0)
            }
            rows.append({**task, "pass_at_k": len(solved) / len(prompts)})
    finally:
        service.close()
        engine.close()
    inside = [r for r in rows if PASS_LOW <= r["pass_at_k"] <= PASS_HIGH]
    chosen = sorted(inside, key=lambda r: abs(r["pass_at_k"] - 0.4))[:CHOSEN]
    print(
        f"task choice: base-model pass@{k} on {problems} held-out problems, chosen in [{PASS_LOW}, {PASS_HIGH}],"
        f" the {CHOSEN} nearest 0.4"
    )
    for r in rows:
        mark = "chosen" if r in chosen else ""
        print(f"  {r['name']:<20}{json.dumps(r['config']):<70}{r['pass_at_k']:>6.3f}  {mark}")
    if not chosen and smoke:  # two problems say nothing about a task: the smoke run goes on with the first
        chosen = rows[:1]
    if not chosen:
        raise SystemExit("no candidate task's pass@8 lies in the range: name tasks with --task")
    return [{"name": r["name"], "config": r["config"]} for r in chosen], rows


def run_config(data: Path, out: Path, seed: int, steps: int, eval_every: int, dtype: str, smoke: bool) -> dict:
    """postrl's run: the numbers TRL gets (``trl_worker``)."""
    from postrl.models.gguf import smollm2_dir

    return {
        "name": "parity",
        "output_dir": str(out),
        "seed": seed,
        "steps": steps,
        "prompts_per_step": 2 if smoke else PROMPTS,
        "model": {"path": str(smollm2_dir())},
        "data": {
            "train_files": [str(data / "train.jsonl")],
            "val_files": [str(data / "heldout.jsonl")],
            "shuffle": False,
            "max_prompt_tokens": 256,
        },
        "rollout": {
            "n": 2 if smoke else G,
            "max_tokens": 8 if smoke else NEW_TOKENS,
            "temperature": 1.0,
            "dtype": dtype,
        },
        "reward": {"components": [{"name": "correct", "type": "reasoning_gym"}], "num_workers": 1},
        "algorithm": {"kl_beta": 0.0, "loss_agg": "token_mean"},
        "train": {
            "lr": LR,
            "mini_batch_size": 4 if smoke else PROMPTS * G,
            "micro_batch_size": 4 if smoke else MICRO,
            "precision": "bf16_autocast",
            "grad_clip": 1.0,
        },
        "checkpoint": {"every_steps": 0},
        "logging": {"eval_every": eval_every, "trackers": ["jsonl"], "console": False, "progress_bar": False},
    }


def task_names(data: Path) -> list[str]:
    return sorted({json.loads(line)["task_type"] for line in (data / "heldout.jsonl").read_text().splitlines()})


def postrl_worker(args: argparse.Namespace) -> dict:
    """postrl's run: every ``eval_every`` steps its own validation; on until the parent says stop
    (TRL's wall time reached) or ``POSTRL_STEP_CAP`` times TRL's steps."""
    import torch

    from postrl.config.loading import build_config
    from postrl.data.dataset import load_prompt_dataset
    from postrl.models.gguf import smollm2_dir
    from postrl.models.loading import load_causal_lm, load_tokenizer
    from postrl.run.interrupt import RunInterrupted
    from postrl.run.train_runner import train
    from postrl.types.metric_names import (
        ACTOR_GRAD_NORM,
        RESPONSE_LENGTH_MEAN,
        REWARD_MEAN,
        TIME_STEP_S,
        TIME_VALIDATE_S,
        VAL_ACCURACY,
        task_accuracy,
    )

    tmp = Path(tempfile.mkdtemp(prefix="parity-postrl-"))
    steps = 2 if args.smoke else args.steps
    config = run_config(args.data, tmp, args.seed, steps * POSTRL_STEP_CAP, args.eval_every, args.dtype, args.smoke)
    tasks = task_names(args.data)
    tokenizer = load_tokenizer(str(smollm2_dir()))
    heldout = load_prompt_dataset([str(args.data / "heldout.jsonl")], tokenizer, max_prompt_tokens=256).prompts
    acc0, tasks0 = accuracy_of(load_causal_lm(str(smollm2_dir())).to(torch.float32), tokenizer, heldout, EVAL_DTYPE)
    curve = [{"step": 0, "wall_s": 0.0, "acc": acc0, "per_task": tasks0}]
    state = {"wall": 0.0, "last": wait_for_turn(step=0, wall_s=0.0, acc=acc0)}

    def on_step(metrics) -> None:
        values = metrics.values
        if metrics.step == 1:  # the run's set-up (model, workers) is not a step: the step's own seconds
            state["wall"] += values[TIME_STEP_S] - values.get(TIME_VALIDATE_S, 0.0)
        else:  # everything between two steps, less the held-out evaluation
            state["wall"] += time.perf_counter() - state["last"] - values.get(TIME_VALIDATE_S, 0.0)
        reply: dict[str, Any] = {
            "step": metrics.step,
            "wall_s": state["wall"],
            "reward": values[REWARD_MEAN],
            "length": values[RESPONSE_LENGTH_MEAN],
            "grad_norm": values[ACTOR_GRAD_NORM],
        }
        if VAL_ACCURACY in values:
            per_task = {t: values[task_accuracy(t, "val")] for t in tasks}
            curve.append(
                {"step": metrics.step, "wall_s": state["wall"], "acc": values[VAL_ACCURACY], "per_task": per_task}
            )
            reply["acc"] = values[VAL_ACCURACY]
        began = turn(**reply)
        if began is None:
            os.kill(os.getpid(), signal.SIGINT)  # the run stops after this step, as at a user's ^C
        state["last"] = began or time.perf_counter()

    try:
        train(build_config(config), on_step=on_step)
    except RunInterrupted:
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the run's checkpoints: gigabytes per seed
    return {"curve": curve, "last": True}


def trl_worker(args: argparse.Namespace) -> dict:
    """TRL's GRPOTrainer on the same file of prompts in the same order, the same settings."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from postrl.data.dataset import load_prompt_dataset
    from postrl.models.gguf import smollm2_dir
    from postrl.models.loading import load_tokenizer
    from postrl.reward.reasoning_gym import score

    model_dir = smollm2_dir()
    tmp = Path(tempfile.mkdtemp(prefix="parity-trl-"))
    tokenizer = load_tokenizer(str(model_dir))
    heldout = load_prompt_dataset([str(args.data / "heldout.jsonl")], tokenizer, max_prompt_tokens=256).prompts
    rows = [json.loads(line) for line in (args.data / "train.jsonl").read_text().splitlines()]
    dataset = Dataset.from_list(
        [
            {
                "prompt": r["messages"],
                "rg_task": r["rg_task"],
                "rg_config": json.dumps(r["rg_config"]),
                "rg_entry": json.dumps(r["rg_entry"]),
            }
            for r in rows
        ]
    )

    def reward(completions, rg_task, rg_config, rg_entry, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [
            score("", t, task, json.loads(cfg), json.loads(entry), rg_answer_format="last_number")
            for t, task, cfg, entry in zip(texts, rg_task, rg_config, rg_entry, strict=True)
        ]

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    acc0, tasks0 = accuracy_of(model, tokenizer, heldout, EVAL_DTYPE)
    curve = [{"step": 0, "wall_s": 0.0, "acc": acc0, "per_task": tasks0}]
    steps = 2 if args.smoke else args.steps

    class Clock(TrainerCallback):
        """A step ends when its log is written (logging_steps=1); evaluation is outside its time."""

        def __init__(self) -> None:
            wait_for_turn(step=0, wall_s=0.0, acc=acc0)
            self.wall, self.last = 0.0, None

        def on_step_begin(self, args_, state, control, **kw):
            if self.last is None:  # the trainer's set-up is not a step
                self.last = time.perf_counter()

        def on_log(self, args_, state, control, logs=None, **kw):
            if not logs or "reward" not in logs:
                return
            self.wall += time.perf_counter() - self.last
            reply: dict[str, Any] = {
                "step": state.global_step,
                "wall_s": self.wall,
                "reward": logs["reward"],
                "length": logs.get("completions/mean_length"),
                "grad_norm": logs.get("grad_norm"),
            }
            over = self.wall >= args.minutes * 60 or state.global_step >= steps
            if state.global_step % args.eval_every == 0 or over:
                acc, per_task = accuracy_of(trainer.model, tokenizer, heldout, EVAL_DTYPE)
                curve.append({"step": state.global_step, "wall_s": self.wall, "acc": acc, "per_task": per_task})
                reply["acc"] = acc
            if over:
                control.should_training_stop = True
            self.last = wait_for_turn(**reply)

    config = GRPOConfig(
        output_dir=str(tmp),
        per_device_train_batch_size=4 if args.smoke else MICRO,
        gradient_accumulation_steps=1 if args.smoke else PROMPTS * G // MICRO,
        num_generations=2 if args.smoke else G,
        max_completion_length=8 if args.smoke else NEW_TOKENS,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        beta=0.0,
        num_iterations=1,
        learning_rate=LR,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        loss_type="dapo",
        scale_rewards="group",
        bf16=True,
        use_cpu=True,
        max_steps=steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=args.seed,
        shuffle_dataset=False,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        callbacks=[Clock()],
    )
    try:
        trainer.train()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"curve": curve, "last": True}


def stop_rule(steps: int):
    """postrl stops once TRL has finished, postrl has taken at least TRL's steps, its wall time has
    reached TRL's, and its last step was evaluated."""

    def stop(name: str, replies: dict[str, list[dict]]) -> bool:
        trl, mine = replies["trl"], replies[name]
        if name != "postrl" or not trl or not trl[-1].get("last") or not mine:
            return False
        trl_wall = trl[-1]["curve"][-1]["wall_s"]
        last = mine[-1]
        return last.get("step", 0) >= steps and last.get("wall_s", 0.0) >= trl_wall and "acc" in last

    return stop


def run_seed(args: argparse.Namespace, seed: int, data: Path) -> dict[str, list[dict]]:
    extra = ["--smoke"] if args.smoke else []
    common = [
        "--seed",
        str(seed),
        "--data",
        str(data),
        "--steps",
        str(args.steps),
        "--eval-every",
        str(args.eval_every),
        "--minutes",
        str(args.minutes),
        "--dtype",
        args.dtype,
        *extra,
    ]
    commands = {f: [sys.executable, __file__, "--worker", f, *common] for f in ("postrl", "trl")}
    replies = run_interleaved(commands, 100_000, args.log, stop_rule(2 if args.smoke else args.steps))
    return {f: replies[f][-1]["curve"] for f in commands}


def mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def acc_at(curve: list[dict], wall_s: float) -> float:
    """The accuracy of the last evaluation at or before ``wall_s``."""
    return [p for p in curve if p["wall_s"] <= wall_s + 1e-9][-1]["acc"]


def summarize(runs: list[dict[str, list[dict]]], tasks: list[dict], steps: int) -> dict:
    """Mean and sd over seeds at each step both evaluated, the gains, the parity condition and the
    equal-wall comparison."""
    common = sorted(set.intersection(*({p["step"] for p in r[f]} for r in runs for f in ("postrl", "trl"))))
    common = [s for s in common if s <= steps]

    def curve(framework: str) -> list[dict]:
        out = []
        for s in common:
            points = [next(p for p in r[framework] if p["step"] == s) for r in runs]
            mean, sd = mean_sd([p["acc"] for p in points])
            per_task = {t: statistics.fmean(p["per_task"][t] for p in points) for t in points[0]["per_task"]}
            wall = statistics.fmean(p["wall_s"] for p in points)
            out.append(
                {
                    "step": s,
                    "mean": round(mean, 4),
                    "sd": round(sd, 4),
                    "wall_s": round(wall, 1),
                    "per_task": {t: round(v, 4) for t, v in per_task.items()},
                }
            )
        return out

    postrl, trl = curve("postrl"), curve("trl")
    trl_walls = [r["trl"][-1]["wall_s"] for r in runs]
    at_wall = statistics.fmean(acc_at(r["postrl"], w) for r, w in zip(runs, trl_walls, strict=True))
    trl_after = statistics.fmean(r["trl"][-1]["acc"] for r in runs)
    parity = all(p["mean"] >= t["mean"] - t["sd"] - 1e-12 for p, t in zip(postrl, trl, strict=True))
    return {
        "steps": common,
        "seeds": len(runs),
        "tasks": tasks,
        "postrl_curve": postrl,
        "trl_curve": trl,
        "postrl_gain": round(postrl[-1]["mean"] - postrl[0]["mean"], 4),
        "trl_gain": round(trl[-1]["mean"] - trl[0]["mean"], 4),
        "parity_ok": parity,
        "postrl_acc_at_trl_wall": round(at_wall, 4),
        "trl_acc_after": round(trl_after, 4),
        "ahead_at_equal_wall": at_wall > trl_after,
        "trl_wall_s": round(statistics.fmean(trl_walls), 1),
        "postrl_steps_at_trl_wall": round(
            statistics.fmean(
                max(p["step"] for p in r["postrl"] if p["wall_s"] <= w + 1e-9)
                for r, w in zip(runs, trl_walls, strict=True)
            ),
            1,
        ),
    }


def report(result: dict) -> None:
    names = "/".join(t["name"] for t in result["tasks"])
    print(f"held-out greedy accuracy ({names}), mean ± sd over {result['seeds']} seeds, SmolLM2-135M-Instruct")
    print(f"{'step':>5}{'postrl':>16}{'TRL':>16}  per task (postrl | TRL)")
    for p, t in zip(result["postrl_curve"], result["trl_curve"], strict=True):
        tasks = "  ".join(f"{k} {p['per_task'][k]:.2f}|{t['per_task'][k]:.2f}" for k in p["per_task"])
        print(f"{p['step']:>5}{p['mean']:>9.3f} ± {p['sd']:.3f}{t['mean']:>9.3f} ± {t['sd']:.3f}  {tasks}")
    print(
        f"gain: postrl {result['postrl_gain']:+.3f}, TRL {result['trl_gain']:+.3f}; "
        f"parity (postrl >= TRL - 1 sd at every step): {'yes' if result['parity_ok'] else 'NO'}"
    )
    print(
        f"at TRL's wall time ({result['trl_wall_s']:.0f} s, {result['steps'][-1]} TRL steps; postrl "
        f"{result['postrl_steps_at_trl_wall']:.1f} steps): postrl {result['postrl_acc_at_trl_wall']:.3f}, "
        f"TRL {result['trl_acc_after']:.3f}: postrl {'ahead' if result['ahead_at_equal_wall'] else 'NOT ahead'}"
    )


def plot(runs: list[dict[str, list[dict]]], result: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_wall) = plt.subplots(1, 2, figsize=(11, 4))
    for name, key in (("postrl", "postrl_curve"), ("TRL GRPOTrainer", "trl_curve")):
        points = result[key]
        steps, means, sds = [p["step"] for p in points], [p["mean"] for p in points], [p["sd"] for p in points]
        line = by_step.errorbar(steps, means, yerr=sds, marker="o", markersize=3, capsize=3, label=name)
        framework = "postrl" if key == "postrl_curve" else "trl"
        for i, r in enumerate(runs):
            curve = r[framework]
            by_wall.plot(
                [p["wall_s"] / 60 for p in curve],
                [p["acc"] for p in curve],
                marker="o",
                markersize=2,
                color=line[0].get_color(),
                alpha=0.7,
                label=name if i == 0 else None,
            )
    by_step.set_xlabel("optimizer step")
    by_step.set_ylabel("held-out greedy accuracy (mean ± sd over seeds)")
    by_wall.set_xlabel("training wall time, minutes (evaluation excluded), one line per seed")
    names = "/".join(t["name"] for t in result["tasks"])
    fig.suptitle(f"SmolLM2-135M-Instruct, reasoning-gym {names}, {PROMPTS}x{G}, lr {LR}", fontsize=9)
    by_wall.legend(fontsize=8)
    save(fig, by_step, png)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--task", action="append", default=[], help="NAME or NAME:JSON config (repeatable)")
    parser.add_argument(
        "--task-set",
        choices=["rule", "real_task"],
        default="rule",
        help="without --task: the rule's choice, or real_task.py's three tasks",
    )
    parser.add_argument("--seeds", type=int, default=3, help="seeds (each its own order of the prompts)")
    parser.add_argument("--steps", type=int, default=8, help="TRL's optimizer steps (postrl: at least as many)")
    parser.add_argument("--eval-every", type=int, default=2, help="steps between held-out evaluations")
    parser.add_argument("--minutes", type=float, default=30.0, help="cap on TRL's training wall time per seed")
    parser.add_argument(
        "--dtype",
        default="float32",
        help="postrl's rollout.dtype: float32, as TRL samples from its float32 model without vLLM; "
        "its validation runs on the same engine, so anything else also changes how postrl "
        "is evaluated",
    )
    parser.add_argument("--png", type=Path, default=Path("docs/learning_parity.png"), help="the curves")
    parser.add_argument(
        "--log",
        type=Path,
        default=Path(__file__).parent / ".cache" / "learning_parity.jsonl",
        help="each step as it ends",
    )
    parser.add_argument("--worker", choices=["postrl", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    add_smoke(parser)
    args = parser.parse_args()
    if (why := missing()) is not None:
        skip(why, args.json)
        return 0
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        skip("TRL is not installed (pip install 'postrl[peers]')", args.json)
        return 0
    if args.worker:
        work = postrl_worker if args.worker == "postrl" else trl_worker
        print(MARK + json.dumps(work(args)), flush=True)
        return 0
    if args.smoke:
        args.seeds, args.steps, args.eval_every = 2, 2, 1
    candidates: list[dict] = []
    if args.task:
        tasks = [parse_task(t) for t in args.task]
    elif args.task_set == "real_task":
        tasks = REAL_TASK_TASKS
    else:
        tasks, candidates = choose_tasks(args.smoke)
    folder = Path(tempfile.mkdtemp(prefix="learning-parity-"))
    args.log.parent.mkdir(parents=True, exist_ok=True)
    runs = [run_seed(args, seed, prepare(tasks, seed, folder, args.smoke)) for seed in range(args.seeds)]
    result = summarize(runs, tasks, 2 if args.smoke else args.steps)
    result["candidates"] = candidates
    report(result)
    if not args.smoke:  # a smoke run (tests/test_benchmarks.py) leaves the committed figure alone
        plot(runs, result, args.png)
        print(f"curves: {args.png}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
