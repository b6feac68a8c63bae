"""On-policy distillation against the RL that made its teacher.

The teacher is made here: SmolLM2-135M-Instruct after GRPO on ``real_task``'s reasoning-gym tasks
for ``--rl-minutes`` of step time (held-out greedy accuracy along the way). The student is the
untrained SmolLM2; it samples on the same prompts with the same batch, group, learning rate and
token limits, and trains on the distillation term alone (``algorithm.distill: {teacher: ...,
task_reward: false}``: each sampled token's advantage is teacher logprob - student logprob) for
``--fraction`` of the RL run's step time (at the RL run's learning rate unless ``--distill-lr``). Both engines sample in float32 (a bf16 engine would
carry little of each update and would skew the student's logprobs against the float32 teacher's).

``reached_fraction`` = (student after - student before) / (teacher - student before): the share of
the RL run's gain that distillation recovered in its fraction of the time. With ``--seeds`` the
student is distilled once per seed (its prompt order and samples; the teacher is the same), and
the top-level figures are the seeds' means, each seed's under ``per_seed``, the spread beside. ``rl_time_to_student``:
when the RL run's curve first reached the student's final accuracy. ``teacher_logprob_calls_per_sample``:
samples sent to the teacher / distinct samples sent (1.0: none was sent twice in the whole run).
The teacher is kept in ``--cache`` by its settings, so a second run distils from the same teacher.

    python benchmarks/distill.py [--json] [--rl-minutes 30] [--fraction 0.25] [--seeds 0 1 2] [--png docs/distill.png]

``--demo``: the same question on the demo. The teacher is ``postrl demo``'s GRPO run (its 100 steps,
kept in ``--cache``); the student is the shipped demo model, distilled with the demo's settings for a
quarter of the teacher's steps with what docs/algorithms.md says to set (``DEMO_STUDENT``), once per
seed; beside each, GRPO alone with the same passes and seed. ``--json`` keys: ``teacher_acc``,
``student_acc_before``, ``student_acc_after``, ``of_teacher_acc``, ``reached_fraction``,
``grpo_same_settings_acc``, ``student_steps``, ``teacher_steps``, ``per_seed``.

    python benchmarks/distill.py --demo [--json] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import real_task  # benchmarks/real_task.py: its tasks, prompts, reward and held-out accuracy
from _figures import save
from _smoke import add_smoke, skip

LR = 1e-5
EVAL_EVERY = 3


def run_config(model_dir: Path, out: Path, name: str, smoke: bool, distill: dict | None, lr: float = LR) -> dict:
    """``real_task``'s run (tasks, prompts per step, group, tokens, reward), sampled in float32."""
    config = real_task.run_config(model_dir, out, smoke, 1 if smoke else EVAL_EVERY)
    config["name"] = name
    config["rollout"]["dtype"] = "float32"
    config["train"]["lr"] = lr
    if distill is not None:
        config["algorithm"] = {**config["algorithm"], "distill": distill}
    return config


def train_for(config: dict, minutes: float) -> tuple[Path, list[dict], float, int]:
    """``postrl train`` until ``minutes`` of step time (stopped after the step that would leave no
    room for another as long): the model it ended with, its held-out curve (the run's own
    validation, its time left out), its step time and its steps."""
    from postrl.config.loading import build_config
    from postrl.run.checkpoint import latest_checkpoint
    from postrl.run.interrupt import RunInterrupted
    from postrl.run.train_runner import train
    from postrl.types.metric_names import TIME_STEP_S, TIME_VALIDATE_S, VAL_ACCURACY

    state = {"wall": 0.0, "steps": 0}
    curve: list[dict] = []

    def on_step(metrics) -> None:
        values = metrics.values
        step_s = values[TIME_STEP_S] - values.get(TIME_VALIDATE_S, 0.0)
        state["wall"] += step_s
        state["steps"] = metrics.step
        if VAL_ACCURACY in values:
            curve.append({"step": metrics.step, "wall_s": state["wall"], "acc": values[VAL_ACCURACY]})
        print(
            f"  {config['name']} step {metrics.step}: {state['wall'] / 60:.1f} min"
            + (f", held-out {values[VAL_ACCURACY]:.3f}" if VAL_ACCURACY in values else ""),
            file=sys.stderr,
        )
        if state["wall"] + step_s > minutes * 60:
            os.kill(os.getpid(), signal.SIGINT)  # as a user's ^C: the run stops after this step

    run = build_config(config)
    try:
        train(run, on_step=on_step)
        final = run.run_dir / "final_model"
    except RunInterrupted:
        final = latest_checkpoint(run.run_dir) / "model"
    return final, curve, state["wall"], int(state["steps"])


def held_out_accuracy(model: Path, prompts: list) -> float:
    import torch

    from postrl.models.loading import load_causal_lm, load_tokenizer

    acc, _ = real_task.accuracy_of(
        load_causal_lm(str(model)).to(torch.float32), load_tokenizer(str(model)), prompts, dtype="float32"
    )
    return acc


def make_teacher(model_dir: Path, cache: Path, minutes: float, smoke: bool, prompts: list) -> dict:
    """The GRPO run that makes the teacher (kept in ``cache`` by its settings)."""
    settings = json.dumps([real_task.TASKS, real_task.PROMPTS, real_task.G, real_task.NEW_TOKENS, LR, minutes, smoke])
    kept = cache / f"teacher-{hashlib.sha256(settings.encode()).hexdigest()[:12]}"
    if (kept / "teacher.json").is_file():
        print(f"  the teacher from {kept}", file=sys.stderr)
        return json.loads((kept / "teacher.json").read_text())
    out = Path(tempfile.mkdtemp(prefix="distill-rl-"))
    final, curve, wall, steps = train_for(run_config(model_dir, out, "rl", smoke, None), minutes)
    shutil.rmtree(kept, ignore_errors=True)
    shutil.copytree(final, kept / "model")
    shutil.rmtree(out, ignore_errors=True)  # its checkpoints are GBs
    made = {
        "model": str(kept / "model"),
        "curve": curve,
        "rl_wall_s": wall,
        "steps": steps,
        "teacher_acc": held_out_accuracy(kept / "model", prompts),
    }
    (kept / "teacher.json").write_text(json.dumps(made))
    return made


def distill(model_dir: Path, teacher: str, minutes: float, smoke: bool, lr: float, seed: int) -> dict:
    """The student distilled from ``teacher`` for ``minutes`` with run seed ``seed``; every sample the
    teacher was sent, counted."""
    from postrl.train.teachers.local_teacher import LocalTeacher

    sent: list[str] = []
    score = LocalTeacher.logprobs

    def counted(self, queries):
        sent.extend(hashlib.blake2b(repr((q.ids, q.start)).encode(), digest_size=12).hexdigest() for q in queries)
        return score(self, queries)

    LocalTeacher.logprobs = counted  # type: ignore[method-assign]
    out = Path(tempfile.mkdtemp(prefix="distill-student-"))
    try:
        config = run_config(model_dir, out, f"student-{seed}", smoke, {"teacher": teacher, "task_reward": False}, lr)
        config["seed"] = seed
        final, curve, wall, steps = train_for(config, minutes)
        kept = out / "student_model"
        shutil.copytree(final, kept)
    finally:
        LocalTeacher.logprobs = score  # type: ignore[method-assign]
    return {
        "model": kept,
        "out": out,
        "curve": curve,
        "wall_s": wall,
        "steps": steps,
        "calls_per_sample": len(sent) / max(1, len(set(sent))),
    }


def plot(rl: list[dict], students: dict[int, list[dict]], before: float, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    curves = {"GRPO (makes the teacher)": rl}
    curves |= {f"on-policy distillation from it, seed {seed}": curve for seed, curve in students.items()}
    for name, curve in curves.items():
        points = [{"wall_s": 0.0, "acc": before}, *curve]
        ax.plot([p["wall_s"] / 60 for p in points], [p["acc"] for p in points], marker="o", markersize=3, label=name)
    ax.set_xlabel("training wall time, minutes (evaluation excluded)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title("SmolLM2-135M-Instruct, reasoning-gym " + "/".join(t["name"] for t in real_task.TASKS), fontsize=9)
    save(fig, ax, png)


def spread(values: list[float]) -> dict[str, float]:
    mean = sum(values) / len(values)
    sd = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0
    return {"mean": round(mean, 4), "sd": round(sd, 4), "min": round(min(values), 4), "max": round(max(values), 4)}


# -- --demo: the shipped demo model, its own GRPO run as the teacher ----------------------------------
# what docs/algorithms.md tells a user to set for distillation (both measured there): two passes over each
# batch, for the student and for GRPO beside it; the teacher's per-token term weighed down beside the task's
DEMO_PASSES = ["train.epochs=2"]
DEMO_STUDENT = [*DEMO_PASSES, "algorithm.distill.weight=0.3"]


def demo_run(name: str, out: Path, steps: int, seed: int, smoke: bool, extra: list[str]) -> tuple[float, float]:
    """The demo's settings (``postrl demo``), ``steps`` steps with run seed ``seed`` and ``extra``
    overrides: the held-out accuracy of the model it made (the demo's own evaluation) and its step time."""
    from postrl.models.loading import load_causal_lm, load_tokenizer
    from postrl.run.demo import demo_config
    from postrl.run.evaluate import evaluate_model
    from postrl.run.train_runner import train
    from postrl.types.metric_names import TIME_STEP_S

    wall = []
    overrides = [f"name={name}", f"output_dir={out}", f"steps={steps}", f"seed={seed}", "logging.console=false"]
    overrides += ["prompts_per_step=4"] if smoke else []
    config = demo_config(overrides + extra)
    train(config, on_step=lambda m: wall.append(m.values[TIME_STEP_S]))
    model = load_causal_lm(str(config.run_dir / "final_model"))
    held_out = evaluate_model(model, load_tokenizer(config.model.path), "arithmetic", rollout=config.rollout)
    return held_out.accuracy, sum(wall)


def demo_teacher(cache: Path, smoke: bool) -> dict:
    """``postrl demo``'s GRPO run, kept in ``cache`` by its settings: the teacher."""
    from postrl.run.demo import DEMO_SETTINGS

    steps = 2 if smoke else DEMO_SETTINGS["steps"]
    kept = cache / f"demo-teacher-{hashlib.sha256(json.dumps([DEMO_SETTINGS, steps]).encode()).hexdigest()[:12]}"
    if (kept / "teacher.json").is_file():
        print(f"  the teacher from {kept}", file=sys.stderr)
        return json.loads((kept / "teacher.json").read_text())
    out = Path(tempfile.mkdtemp(prefix="distill-demo-"))
    acc, wall = demo_run("teacher", out, steps, 0, smoke, [])
    shutil.rmtree(kept, ignore_errors=True)
    shutil.copytree(out / "teacher" / "final_model", kept / "model")
    shutil.rmtree(out, ignore_errors=True)
    made = {"model": str(kept / "model"), "teacher_acc": acc, "teacher_steps": steps, "teacher_wall_s": wall}
    (kept / "teacher.json").write_text(json.dumps(made))
    return made


def demo_main(args: argparse.Namespace) -> dict:
    """The student (the shipped demo model) distilled from the demo's GRPO-trained model for a
    quarter of the teacher's steps, over ``args.seeds``; beside each, GRPO alone with the student's
    settings and seed (what the teacher adds over the task's own reward)."""
    from postrl.models.loading import load_causal_lm, load_tokenizer
    from postrl.run.evaluate import evaluate_model

    teacher = demo_teacher(args.cache, args.smoke)
    before = evaluate_model(load_causal_lm("demo"), load_tokenizer("demo"), "arithmetic").accuracy
    steps = max(1, teacher["teacher_steps"] // 4)
    gain = teacher["teacher_acc"] - before
    per_seed = []
    for seed in args.seeds:
        out = Path(tempfile.mkdtemp(prefix="distill-demo-"))
        try:
            distill = [f"algorithm.distill.teacher={teacher['model']}", *DEMO_STUDENT]
            after, wall = demo_run("student", out, steps, seed, args.smoke, distill)
            grpo, grpo_wall = demo_run("grpo", out, steps, seed, args.smoke, DEMO_PASSES)
        finally:
            shutil.rmtree(out, ignore_errors=True)
        per_seed.append(
            {
                "seed": seed,
                "student_acc_after": round(after, 4),
                "of_teacher_acc": round(after / teacher["teacher_acc"], 3) if teacher["teacher_acc"] else None,
                "reached_fraction": round((after - before) / gain, 3) if gain > 0 else None,
                "grpo_same_settings_acc": round(grpo, 4),
                "student_wall_s": round(wall, 1),
                "grpo_wall_s": round(grpo_wall, 1),
            }
        )
    fractions = [s["reached_fraction"] for s in per_seed if s["reached_fraction"] is not None]
    return {
        "teacher_acc": round(teacher["teacher_acc"], 4),
        "student_acc_before": round(before, 4),
        "student_acc_after": spread([s["student_acc_after"] for s in per_seed])["mean"],
        "student_acc_after_spread": spread([s["student_acc_after"] for s in per_seed]),
        "of_teacher_acc": spread([s["of_teacher_acc"] for s in per_seed if s["of_teacher_acc"] is not None])["mean"],
        "reached_fraction": spread(fractions)["mean"] if fractions else None,
        "reached_fraction_spread": spread(fractions) if fractions else None,
        "grpo_same_settings_acc": spread([s["grpo_same_settings_acc"] for s in per_seed])["mean"],
        "student_steps": steps,
        "teacher_steps": teacher["teacher_steps"],
        "student_settings": DEMO_STUDENT,
        "seeds": list(args.seeds),
        "per_seed": per_seed,
    }


def print_demo(result: dict) -> None:
    print("held-out greedy accuracy on the demo's 200 problems (arithmetic), the shipped demo model as the student")
    print(f"{'':34s}{'accuracy':>10s}{'steps':>7s}{'of teacher':>12s}{'reached':>9s}")
    print(f"{'student before':34s}{result['student_acc_before']:10.3f}")
    print(f"{'teacher (postrl demo: GRPO)':34s}{result['teacher_acc']:10.3f}{result['teacher_steps']:7d}")
    for s in result["per_seed"]:
        print(
            f"{'student, seed ' + str(s['seed']):34s}{s['student_acc_after']:10.3f}{result['student_steps']:7d}"
            f"{s['of_teacher_acc']!s:>12s}{s['reached_fraction']!s:>9s}"
        )
        print(f"{'  GRPO alone, same settings':34s}{s['grpo_same_settings_acc']:10.3f}{result['student_steps']:7d}")
    print(
        f"student {result['student_acc_after']} = {result['of_teacher_acc']} of the teacher's accuracy, reached_fraction "
        f"{result['reached_fraction']} (seeds {result['reached_fraction_spread']}) in {result['student_steps']} of "
        f"the teacher's {result['teacher_steps']} steps; GRPO alone with the student's settings "
        f"{result['grpo_same_settings_acc']}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--rl-minutes", type=float, default=30.0, help="the teacher's GRPO step time")
    parser.add_argument(
        "--fraction", type=float, default=0.25, help="the student's step time, as a share of the RL run's"
    )
    parser.add_argument(
        "--distill-lr", type=float, default=LR, help="the student's learning rate (default: the RL run's)"
    )
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0], help="the student's run seeds (one distillation each)"
    )
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "postrl-distill")
    parser.add_argument("--png", type=Path, default=Path("docs/distill.png"), help="the two curves")
    parser.add_argument(
        "--demo",
        action="store_true",
        help="the demo model distilled from the demo's own GRPO run (quarter of its steps), beside GRPO alone",
    )
    add_smoke(parser)
    args = parser.parse_args()
    if args.demo:
        result = demo_main(args)
        print_demo(result)
        if args.json:
            print(json.dumps(result))
        return 0
    if (why := real_task.missing()) is not None:
        skip(why, args.json)
        return 0
    from postrl.models.gguf import smollm2_dir
    from postrl.models.loading import load_tokenizer

    model_dir = smollm2_dir()
    probe = run_config(model_dir, Path(tempfile.gettempdir()), "probe", args.smoke, None)
    prompts = real_task.heldout(probe, load_tokenizer(str(model_dir)))
    began = time.perf_counter()
    before = held_out_accuracy(model_dir, prompts)
    teacher = make_teacher(model_dir, args.cache, 0.05 if args.smoke else args.rl_minutes, args.smoke, prompts)
    gain = teacher["teacher_acc"] - before
    per_seed, students = [], {}
    for seed in args.seeds:
        student = distill(
            model_dir, teacher["model"], args.fraction * teacher["rl_wall_s"] / 60, args.smoke, args.distill_lr, seed
        )
        after = held_out_accuracy(student["model"], prompts)
        shutil.rmtree(student["out"], ignore_errors=True)
        reached = next((p["wall_s"] for p in teacher["curve"] if p["acc"] >= after), None)
        students[seed] = student["curve"]
        per_seed.append(
            {
                "seed": seed,
                "student_acc_after": round(after, 4),
                "reached_fraction": round((after - before) / gain, 3) if gain > 0 else None,
                "distill_wall_s": round(student["wall_s"], 1),
                "distill_to_rl_wall": round(student["wall_s"] / teacher["rl_wall_s"], 3),
                "rl_time_to_student_s": None if reached is None else round(reached, 1),
                "teacher_logprob_calls_per_sample": round(student["calls_per_sample"], 4),
                "distill_steps": student["steps"],
                "curve_distill": [(round(p["wall_s"], 1), round(p["acc"], 4)) for p in student["curve"]],
            }
        )
    fractions = [s["reached_fraction"] for s in per_seed if s["reached_fraction"] is not None]
    result = {
        "teacher_acc": round(teacher["teacher_acc"], 4),
        "student_acc_before": round(before, 4),
        "student_acc_after": spread([s["student_acc_after"] for s in per_seed])["mean"],
        "reached_fraction": spread(fractions)["mean"] if fractions else None,
        "reached_fraction_spread": spread(fractions) if fractions else None,
        "distill_wall_s": spread([s["distill_wall_s"] for s in per_seed])["mean"],
        "rl_wall_s": round(teacher["rl_wall_s"], 1),
        "distill_to_rl_wall": max(s["distill_to_rl_wall"] for s in per_seed),
        "teacher_logprob_calls_per_sample": max(s["teacher_logprob_calls_per_sample"] for s in per_seed),
        "seeds": list(args.seeds),
        "per_seed": per_seed,
        "rl_steps": teacher["steps"],
        "lr": LR,
        "distill_lr": args.distill_lr,
        "heldout": len(prompts),
        "curve_rl": [(round(p["wall_s"], 1), round(p["acc"], 4)) for p in teacher["curve"]],
        "minutes": round((time.perf_counter() - began) / 60, 1),
    }
    print(f"held-out greedy accuracy, {len(prompts)} problems never trained on (SmolLM2-135M-Instruct)")
    print(f"{'':28s}{'accuracy':>10s}{'step time s':>13s}{'steps':>7s}{'reached':>9s}")
    print(f"{'student before':28s}{before:10.3f}")
    print(f"{'teacher (GRPO)':28s}{teacher['teacher_acc']:10.3f}{teacher['rl_wall_s']:13.0f}{teacher['steps']:7d}")
    for s in per_seed:
        label = f"student, seed {s['seed']}"
        print(
            f"{label:28s}{s['student_acc_after']:10.3f}{s['distill_wall_s']:13.0f}{s['distill_steps']:7d}"
            f"{s['reached_fraction']!s:>9s}"
        )
    print(
        f"reached_fraction {result['reached_fraction']} (seeds {result['reached_fraction_spread']}) in at most "
        f"{result['distill_to_rl_wall']} of the RL run's time; teacher calls per sample "
        f"{result['teacher_logprob_calls_per_sample']}"
    )
    if not args.smoke:
        plot(teacher["curve"], students, before, args.png)
        print(f"curves: {args.png}")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
