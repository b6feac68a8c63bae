"""One full GRPO step (generate, score, train) with postrl and with TRL's GRPOTrainer, same workload.

SmolLM2-135M-Instruct, 16 prompts x G=8, 64 new tokens, temperature 1, beta=0, one epoch, one
optimizer step per GRPO step over all 128 completions in micro-batches of 16, the same reward
function (last integer == answer). postrl: native bf16 rollout, bf16-autocast training with fp32
weights and optimizer. TRL: `bf16=True`
on the CPU (its fastest setting that works here). The first step of each is a warm-up and is not
timed. Each framework runs in a process of its own; its peak memory is that process's resident
high-water mark over the whole run (model loading, generation and training). The three warm-up
steps run one after the other; then the timed steps run one at a time, interleaved (postrl, LoRA, TRL, in an
order that rotates every step), the others waiting, so that a slow phase of the shared machine
hits all three. The spread is each framework's fastest and slowest timed step. `--curve` runs 30
steps of postrl (full fine-tuning) and TRL, interleaved the same way, writes each step's reward to
``--curve-log`` as it comes (a stopped run keeps what it measured), prints both reward curves and
plots them into ``--png``.

    python benchmarks/grpo_step.py [--json] [--steps 3] [--curve [--png docs/grpo_curve_vs_trl.png]]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from _figures import save
from _interleave import MARK, run_interleaved, wait_for_turn
from _smoke import add_smoke, skip

from postrl.tasks import chat_addition

PROMPTS, G, NEW_TOKENS, MICRO, LR = 16, 8, 64, 16, 1e-6


@dataclass(frozen=True)
class Sizes:
    """A step's prompts, samples per prompt, new tokens and micro-batch."""

    prompts: int = PROMPTS
    group: int = G
    new_tokens: int = NEW_TOKENS
    micro: int = MICRO


SMOKE_SIZES = Sizes(prompts=2, group=2, new_tokens=4, micro=4)  # --smoke: the same path in seconds a step


def run_postrl(model_dir: Path, data: Path, out: Path, steps: int, lora: bool = False, sizes: Sizes = Sizes()) -> dict:
    """postrl's run; ``lora``: r=16 adapters on every projection (lr 10x), synced as adapters."""
    from postrl.config.loading import build_config
    from postrl.run.train_runner import train

    config = build_config(
        {
            "name": "grpo-step",
            "output_dir": str(out),
            "seed": 0,
            "steps": steps,
            "prompts_per_step": sizes.prompts,
            "model": {"path": str(model_dir), "lora": {"r": 16, "alpha": 32.0} if lora else None},
            "data": {"train_files": [str(data)], "max_prompt_tokens": 256},
            "rollout": {"n": sizes.group, "max_tokens": sizes.new_tokens, "temperature": 1.0, "dtype": "auto"},
            "reward": {
                "components": [{"name": "correct", "type": "custom", "function": "postrl.tasks.chat_addition:score"}],
                "num_workers": 1,
            },
            "algorithm": {"kl_beta": 0.0},
            "train": {
                "lr": LR * 10 if lora else LR,
                "mini_batch_size": sizes.prompts * sizes.group,
                "micro_batch_size": sizes.micro,
                "epochs": 1,
                "precision": "bf16_autocast",
            },
            "checkpoint": {"every_steps": 0},
            "logging": {"progress_bar": False, "trackers": ["jsonl"], "console": False},
        }
    )
    times, rewards, phases = [], [], []
    last = [time.perf_counter()]

    def on_step(metrics) -> None:
        times.append(time.perf_counter() - last[0])
        rewards.append(metrics.values["reward/mean"])
        phases.append({k: round(metrics.values[f"time/{k}_s"], 1) for k in ("generate", "reward", "train", "sync")})
        last[0] = wait_for_turn(step_s=times[-1], reward=rewards[-1])

    train(config, on_step=on_step)
    return {"step_s": times, "reward": rewards, "phases": phases}


def run_trl(model_dir: Path, data_rows: list[dict], out: Path, steps: int, sizes: Sizes = Sizes()) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    def reward(completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [chat_addition.score("", t, a) for t, a in zip(texts, answer)]

    class Timer(TrainerCallback):
        """A step ends when its log (with its reward) is written: logging_steps=1 logs every step."""

        def __init__(self) -> None:
            self.times, self.last = [], None

        def on_step_begin(self, args, state, control, **kw):
            if self.last is None:
                self.last = time.perf_counter()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                self.times.append(time.perf_counter() - self.last)
                self.last = wait_for_turn(step_s=self.times[-1], reward=logs["reward"])

    dataset = Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in data_rows])
    args = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=sizes.micro,
        gradient_accumulation_steps=max(1, sizes.prompts * sizes.group // sizes.micro),
        num_generations=sizes.group,
        max_completion_length=sizes.new_tokens,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        beta=0.0,
        num_iterations=1,
        learning_rate=LR,
        bf16=True,
        use_cpu=True,
        max_steps=steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=0,
        shuffle_dataset=True,
    )
    timer = Timer()
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        callbacks=[timer],
    )
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"step_s": timer.times, "reward": rewards}


def run_worker(framework: str, steps: int, sizes: Sizes = Sizes()) -> dict:
    """One framework's run in this process; its peak resident memory is the process's."""
    from postrl.models.gguf import smollm2_dir
    from postrl.train.memory import resident_high_water_mb

    model_dir = smollm2_dir()
    with tempfile.TemporaryDirectory() as tmp:
        if framework in ("postrl", "postrl_lora"):
            data = chat_addition.write_jsonl(Path(tmp) / "addition.jsonl", 2000)
            result = run_postrl(model_dir, data, Path(tmp) / "postrl", steps, framework == "postrl_lora", sizes)
        else:
            result = run_trl(model_dir, chat_addition.rows(2000), Path(tmp) / "trl", steps, sizes)
    return {**result, "peak_mb": resident_high_water_mb()}


def run_frameworks(frameworks: list[str], steps: int, log: Path | None = None, smoke: bool = False) -> dict[str, dict]:
    """The frameworks' runs interleaved step by step (:func:`_interleave.run_interleaved`); each
    one's result is its last reply, sent after its last step."""
    smoke_flag = ["--smoke"] if smoke else []
    commands = {f: [sys.executable, __file__, "--worker", f, "--steps", str(steps), *smoke_flag] for f in frameworks}
    return {name: replies[-1] for name, replies in run_interleaved(commands, steps, log).items()}


def plot_curves(curves: dict[str, list[float]], png: Path) -> None:
    """Reward per step of each framework, one line each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rewards in curves.items():
        ax.plot(range(1, len(rewards) + 1), rewards, marker="o", markersize=3, label=name)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward (mean over 16 prompts x 8 samples)")
    ax.set_title(f"SmolLM2-135M-Instruct, chat addition, {PROMPTS}x{G}, {NEW_TOKENS} new tokens, bf16")
    save(fig, ax, png)


def missing_peers() -> str | None:
    """Why this machine cannot run the comparison: TRL (scripts/setup_bench.sh) or SmolLM2 missing."""
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        return "TRL is not installed (scripts/setup_bench.sh installs the peers)"
    try:
        from postrl.models.gguf import smollm2_gguf_path

        smollm2_gguf_path()
    except FileNotFoundError as exc:
        return str(exc)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--steps", type=int, default=3, help="steps per framework; the first is a warm-up")
    parser.add_argument(
        "--curve", action="store_true", help="30 steps of postrl and TRL; print and plot the reward curves"
    )
    parser.add_argument(
        "--png", type=Path, default=Path("docs/grpo_curve_vs_trl.png"), help="the curves' plot (--curve)"
    )
    parser.add_argument(
        "--curve-log", type=Path, default=Path("grpo_curve.jsonl"), help="each step as it ends (--curve)"
    )
    parser.add_argument("--worker", choices=["postrl", "postrl_lora", "trl"], help=argparse.SUPPRESS)
    add_smoke(parser)
    args = parser.parse_args()
    if args.smoke and (missing := missing_peers()) is not None:
        skip(missing, args.json)
        return 0
    steps = 2 if args.smoke else 30 if args.curve else max(2, args.steps)
    if args.worker:
        sizes = SMOKE_SIZES if args.smoke else Sizes()
        print(MARK + json.dumps({**run_worker(args.worker, steps, sizes), "last": True}), flush=True)
        return 0
    if args.curve:
        return report_curves(run_frameworks(["postrl", "trl"], steps, args.curve_log), args.png, args.json)
    runs = run_frameworks(["postrl", "postrl_lora", "trl"], steps, smoke=args.smoke)
    postrl, lora, trl = runs["postrl"], runs["postrl_lora"], runs["trl"]
    p_s = sum(postrl["step_s"][1:]) / len(postrl["step_s"][1:])
    l_s = sum(lora["step_s"][1:]) / len(lora["step_s"][1:])
    t_s = sum(trl["step_s"][1:]) / len(trl["step_s"][1:])
    print(
        f"GRPO step, SmolLM2-135M-Instruct, {PROMPTS} prompts x G={G}, {NEW_TOKENS} new tokens, beta=0, "
        f"micro-batch {MICRO}, {torch.get_num_threads()} threads"
    )
    print(f"{'framework':<10}{'s/step':>10}{'peak MB':>10}  per-step seconds")
    print(f"{'postrl':<10}{p_s:>10.1f}{postrl['peak_mb']:>10.0f}  {[round(x, 1) for x in postrl['step_s']]}")
    print(f"{'LoRA r=16':<10}{l_s:>10.1f}{lora['peak_mb']:>10.0f}  {[round(x, 1) for x in lora['step_s']]}")
    print(f"{'TRL':<10}{t_s:>10.1f}{trl['peak_mb']:>10.0f}  {[round(x, 1) for x in trl['step_s']]}")
    per_round = [t / p for p, t in zip(postrl["step_s"][1:], trl["step_s"][1:])]
    lora_round = [p / q for p, q in zip(postrl["step_s"][1:], lora["step_s"][1:])]
    print(
        f"speedup: {t_s / p_s:.2f}x (rounds {min(per_round):.2f}-{max(per_round):.2f}); "
        f"LoRA vs full: {p_s / l_s:.2f}x (rounds {min(lora_round):.2f}-{max(lora_round):.2f})"
    )
    print(f"postrl phases per step: {postrl['phases']}; LoRA: {lora['phases']}")
    if args.json:
        row = {
            "postrl_s_per_step": round(p_s, 2),
            "trl_s_per_step": round(t_s, 2),
            "speedup": round(t_s / p_s, 3),
            "speedup_rounds": [round(x, 3) for x in per_round],
            "postrl_lora_s_per_step": round(l_s, 2),
            "lora_speedup": round(p_s / l_s, 3),
            "lora_speedup_rounds": [round(x, 3) for x in lora_round],
            "postrl_lora_peak_mb": round(lora["peak_mb"]),
            "postrl_peak_mb": round(postrl["peak_mb"]),
            "trl_peak_mb": round(trl["peak_mb"]),
        }
        print(json.dumps(row))
    return 0


def report_curves(runs: dict[str, dict], png: Path, as_json: bool) -> int:
    """Both reward curves as a table and a plot; the last 5 steps' mean beside step 30's value
    (one step's mean over 128 samples is noisy)."""
    postrl, trl = runs["postrl"]["reward"], runs["trl"]["reward"]
    print(f"{'step':>4}{'postrl reward':>15}{'TRL reward':>12}")
    for i, (a, b) in enumerate(zip(postrl, trl), start=1):
        print(f"{i:>4}{a:>15.3f}{b:>12.3f}")
    tail = min(5, len(postrl), len(trl))
    row = {
        "steps": len(postrl),
        "postrl_reward": [round(x, 4) for x in postrl],
        "trl_reward": [round(x, 4) for x in trl],
        "postrl_final": round(postrl[-1], 4),
        "trl_final": round(trl[-1], 4),
        "postrl_last5_mean": round(sum(postrl[-tail:]) / tail, 4),
        "trl_last5_mean": round(sum(trl[-tail:]) / tail, 4),
        "postrl_s_per_step": round(sum(runs["postrl"]["step_s"]) / len(postrl), 1),
        "trl_s_per_step": round(sum(runs["trl"]["step_s"]) / len(trl), 1),
    }
    print(
        f"step {row['steps']}: postrl {row['postrl_final']:.3f}, TRL {row['trl_final']:.3f}; "
        f"last {tail} steps' mean: postrl {row['postrl_last5_mean']:.3f}, TRL {row['trl_last5_mean']:.3f}"
    )
    plot_curves({"postrl": postrl, "TRL GRPOTrainer": trl}, png)
    print(f"plot: {png}")
    if as_json:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
