"""The model card (``README.md``) of a trained model folder: what it was trained from and on, and how
it was prompted in training, so that whoever loads it next prompts it the same way (a model trained
on bare prompts answers them, not the chat template its tokenizer happens to carry)."""

from __future__ import annotations

from pathlib import Path

from postrl.config.data import DataConfig
from postrl.config.run import RunConfig


def trained_how(config: RunConfig, steps: int) -> str:
    """``postrl train, 100 steps of grpo advantages with the ppo_clip loss`` (and its teachers)."""
    a = config.algorithm
    teachers = f", distilled from {', '.join(t.source for t in a.distill.teachers)}" if a.distill else ""
    return f"`postrl train`, {steps} step{'s' if steps != 1 else ''} of {a.advantage.type} advantages with the {a.policy_loss.type} loss{teachers}"


def prompting(data: DataConfig, has_chat_template: bool) -> str:
    """How the training prompts were turned into tokens, as advice to the model's next user."""
    rows = f"a `{data.prompt_column}` string"
    if data.apply_chat_template:
        text = (
            f"Prompts given as {rows} were wrapped as one user message and rendered with the tokenizer's chat "
            "template (`tokenizer.apply_chat_template(messages, add_generation_prompt=True)`)."
        )
    else:
        template = " The tokenizer's chat template was not used for them" if has_chat_template else ""
        text = (
            f"Prompts given as {rows} were tokenized as they are (`tokenizer(prompt)`, no chat template).{template}: "
            "prompt the model with the same bare text; a chat-formatted prompt is one it never saw in training."
        )
    return (
        f"{text} Rows given as `{data.messages_column}` (chat messages) were rendered with the chat template "
        "and a generation prompt."
    )


def example(data: DataConfig) -> str:
    """A built-in task's first held-out problem as the model was asked it, or nothing."""
    if data.task is None:
        return ""
    from postrl.tasks import task_rows

    rows = task_rows(data.task, "test")
    if not rows or "prompt" not in rows[0][1]:
        return ""
    row = rows[0][1]
    answer = f", whose expected answer is `{row['answer']}`" if "answer" in row else ""
    return f"\n\nFor example (task `{data.task}`): the prompt `{row['prompt']}`{answer}."


def write_model_card(folder: Path, title: str, base: str, data: DataConfig, how: str, has_chat_template: bool) -> Path:
    """``folder/README.md``: ``base`` (the model trained), ``how`` (one line: the command, steps,
    algorithm), the data and how it was prompted."""
    source = f"the built-in task `{data.task}`" if data.task else ", ".join(f"`{f}`" for f in data.train_files)
    card = (
        f"# {title}\n\nTrained by postrl from `{base}`: {how}, on {source}.\n\n"
        f"## Prompting\n\n{prompting(data, has_chat_template)}{example(data)}\n"
    )
    path = folder / "README.md"
    path.write_text(card)
    return path
