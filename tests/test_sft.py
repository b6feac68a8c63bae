"""postrl sft: token masks by hand, the loss against a direct NLL computation, a run from another
working directory that is stopped and resumed, 2 FSDP2 ranks against one process, and a bad row."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from postrl.cli import main
from postrl.config.run import TrainConfig
from postrl.data.dataset import DatasetError
from postrl.data.sft import conversation_tokens, load_sft_examples
from postrl.models.loading import load_causal_lm
from postrl.run.metrics import read_metrics
from postrl.run.sft_runner import SFT_ALGORITHM, sft_batch
from postrl.train.worker import PolicyTrainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_assistant_turns_carry_the_loss(char_tokenizer):
    messages = [
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2+2="},
        {"role": "assistant", "content": "4"},
    ]
    ids, mask = conversation_tokens(char_tokenizer, messages)
    text = char_tokenizer.apply_chat_template(messages, tokenize=False)
    assert ids == char_tokenizer(text, add_special_tokens=False)["input_ids"]
    trained = char_tokenizer.decode([i for i, m in zip(ids, mask) if m])
    # each assistant turn's content and its end-of-turn marker; never a header or a user turn
    assert trained == "2<|im_end|>\n4<|im_end|>\n"


def test_prompt_response_rows_and_bad_rows(tmp_path, char_tokenizer):
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"prompt": "12+1=", "response": "13"}) + "\n" + json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(DatasetError, match=r"sft.jsonl:2: row needs 'prompt' and 'response', or 'messages'"):
        load_sft_examples([str(data)], char_tokenizer)
    examples, skipped = load_sft_examples([str(data)], char_tokenizer, on_bad_row="skip")
    assert len(examples) == 1 and skipped == [
        f"{data}:2: row needs 'prompt' and 'response', or 'messages' (columns: ['prompt'])"
    ]
    e = examples[0]
    assert char_tokenizer.decode(e.prompt_ids, skip_special_tokens=True) == "12+1="
    assert e.response_ids[-1] == char_tokenizer.eos_token_id and e.loss_mask == [1] * len(e.response_ids)


def test_the_loss_is_the_mean_nll_of_the_trained_tokens(tmp_path, tiny_model_dir, char_tokenizer):
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "response": str(a + 1)}) + "\n" for a in (5, 17, 123)))
    examples, _ = load_sft_examples([str(data)], char_tokenizer)
    model = load_causal_lm(str(tiny_model_dir))
    nll, count = 0.0, 0
    with torch.no_grad():  # by hand: -log p of each response token given everything before it
        for e in examples:
            ids = torch.tensor([e.prompt_ids + e.response_ids])
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
            targets = ids[0, 1:]
            picked = logp[torch.arange(len(targets)), targets][len(e.prompt_ids) - 1 :]
            nll -= float(picked.sum())
            count += len(e.response_ids)
    train = TrainConfig(lr=1e-3, mini_batch_size=3, micro_batch_size=2, device="cpu")
    worker = PolicyTrainer(model, train, SFT_ALGORITHM, temperature=1.0, seed=0)
    metrics = worker.update(sft_batch(examples, char_tokenizer.pad_token_id))
    assert metrics.get("actor/loss") == pytest.approx(nll / count, rel=1e-5)
    assert metrics.optimizer_steps == 1


def _write_data(folder):
    rows = [{"prompt": f"{a}+{b}=", "response": f"<answer>{a + b}</answer>"} for a in range(10, 18) for b in (3, 4)]
    (folder / "mine.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "sft.yaml").write_text(
        "name: my-sft\nepochs: 2\nmodel: {path: " + str(folder / "model") + "}\n"
        "data: {train_files: [mine.jsonl]}\n"
        "train: {lr: 1.0e-3, mini_batch_size: 4, micro_batch_size: 2, device: cpu, lr_schedule: linear}\n"
        "checkpoint: {every_steps: 2}\nlogging: {trackers: [jsonl]}\n"
    )


def test_a_run_from_another_directory_stopped_and_resumed(tmp_path, tiny_model_dir, capsys, monkeypatch):
    import shutil

    project = tmp_path / "project"
    project.mkdir()
    shutil.copytree(tiny_model_dir, project / "model")
    _write_data(project)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    config = str(project / "sft.yaml")
    assert main(["sft", config, "epochs=1"]) == 0  # 16 rows / 4 = 4 steps
    run = work / "runs" / "my-sft"
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4]
    out = capsys.readouterr()
    assert "step 1/4 | loss " in out.out
    assert main(["sft", "--resume", str(run), "epochs=2"]) == 0
    out = capsys.readouterr()
    assert "resume changes: epochs 1 -> 2" in out.err and "resumed runs/my-sft from step 4" in out.out
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 9))
    # the same 8 steps in one go give the same losses: the resume continued exactly
    assert main(["sft", config, "name=one-go", "train.lr_decay_steps=4"]) == 0  # the horizon the first launch set
    one_go = read_metrics(work / "runs" / "one-go" / "metrics.jsonl")
    assert [r["sft/loss"] for r in one_go] == pytest.approx([r["sft/loss"] for r in rows], rel=1e-6)
    assert one_go[-1]["sft/loss"] < one_go[0]["sft/loss"]
    assert main(["sft", "--resume", str(run), "epochs=1"]) == 2
    assert "epochs=1 gives 4 steps, below the 8 this run has already done" in capsys.readouterr().err
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(run / "final_model") is not None


@pytest.mark.slow
def test_two_fsdp_ranks_give_the_one_process_losses(tmp_path, tiny_model_dir):
    import shutil

    shutil.copytree(tiny_model_dir, tmp_path / "model")
    _write_data(tmp_path)
    runs = []
    for name, workers in (("one", 1), ("two", 2)):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "postrl.cli",
                "sft",
                str(tmp_path / "sft.yaml"),
                f"name={name}",
                f"output_dir={tmp_path / 'runs'}",
                "epochs=1",
                f"scheduler.train.workers={workers}",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(read_metrics(tmp_path / "runs" / name / "metrics.jsonl"))
    assert [r["sft/loss"] for r in runs[1]] == pytest.approx([r["sft/loss"] for r in runs[0]], abs=1e-5)
