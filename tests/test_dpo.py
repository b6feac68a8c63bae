"""DPO: the losses by hand, preference rows with file:line errors, and `postrl dpo` end to end
(reference log-probabilities cached once, preferences learned, checkpoint and resume)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from postrl.algorithms import DPO_LOSSES
from postrl.algorithms.preference import margin
from postrl.cli import main
from postrl.data.dataset import DatasetError
from postrl.data.preferences import load_preference_pairs


def test_dpo_losses_by_hand():
    # policy (chosen, rejected) = (-1, -3), reference = (-2, -2): z = (-1 + 2) - (-3 + 2) = 2
    z = margin(torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0]))
    assert z.item() == 2.0
    beta = 0.5
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert DPO_LOSSES.get("sigmoid")(z, beta).item() == pytest.approx(-math.log(sig(1.0)))
    assert DPO_LOSSES.get("cdpo")(z, beta, 0.1).item() == pytest.approx(
        -0.9 * math.log(sig(1.0)) - 0.1 * math.log(sig(-1.0))
    )
    assert DPO_LOSSES.get("ipo")(z, beta).item() == pytest.approx((2.0 - 1.0) ** 2)  # (z - 1/(2 beta))^2
    with pytest.raises(ValueError, match="label_smoothing > 0"):
        DPO_LOSSES.get("cdpo")(z, beta, 0.0)


def write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_preference_rows_strings_messages_and_errors(tmp_path, char_tokenizer):
    good = write(
        tmp_path / "p.jsonl",
        [
            {"prompt": "1+1=", "chosen": "2", "rejected": "3"},
            {
                "chosen": [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}],
                "rejected": [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "5"}],
            },
        ],
    )
    pairs, skipped = load_preference_pairs([str(good)], char_tokenizer, max_tokens=64)
    assert len(pairs) == 2 and not skipped
    eos = char_tokenizer.eos_token_id
    assert pairs[0].chosen_ids[-1] == eos and pairs[0].chosen_ids != pairs[0].rejected_ids
    assert pairs[1].source == f"{good}:2"
    bad = write(
        tmp_path / "bad.jsonl",
        [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}, {"prompt": "1+1=", "chosen": "2"}, "{not json"],
    )
    with pytest.raises(DatasetError, match=f"{bad}:2: row lacks \\['rejected'\\]"):
        load_preference_pairs([str(bad)], char_tokenizer, max_tokens=64)
    pairs, skipped = load_preference_pairs([str(bad)], char_tokenizer, max_tokens=64, on_bad_row="skip")
    assert len(pairs) == 1 and skipped[1].startswith(f"{bad}:3: invalid JSON at column 2")
    with pytest.raises(DatasetError, match="more than data.max_tokens=4"):
        load_preference_pairs([str(good)], char_tokenizer, max_tokens=4)


def test_postrl_dpo_learns_the_preferences_caches_the_reference_and_resumes(tmp_path, tiny_model_dir):
    rows = [{"prompt": f"{a}+{a}=", "chosen": str(2 * a), "rejected": str(2 * a + 1)} for a in range(10, 26)]
    data = write(tmp_path / "pairs.jsonl", rows)
    config = tmp_path / "dpo.yaml"
    config.write_text(
        f"name: d\noutput_dir: {tmp_path}/runs\nmodel: {{path: {tiny_model_dir}}}\n"
        f"data: {{train_files: [{data}]}}\ndpo: {{beta: 0.5}}\n"
        "train: {lr: 1.0e-2, mini_batch_size: 8, micro_batch_size: 4}\nepochs: 2\n"
        "checkpoint: {every_steps: 2}\nlogging: {trackers: [jsonl]}\n"
    )
    assert main(["dpo", str(config)]) == 0
    run = tmp_path / "runs" / "d"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]  # 16 pairs / 8 per step x 2 epochs
    assert steps[0]["dpo/loss"] == pytest.approx(math.log(2), abs=1e-5)  # the policy starts as the reference
    assert steps[-1]["dpo/loss"] < steps[0]["dpo/loss"] and steps[-1]["dpo/reward_accuracy"] > 0.5
    cached = torch.load(run / "reference_logprobs.pt", weights_only=True)
    assert cached["logprobs"].shape == (16, 2)
    assert (run / "final_model" / "model.safetensors").is_file()
    # resume for a third epoch: the reference is read back, not recomputed from the trained policy
    assert main(["dpo", "--resume", str(run), "epochs=3"]) == 0
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    assert torch.equal(torch.load(run / "reference_logprobs.pt", weights_only=True)["logprobs"], cached["logprobs"])


def test_dpo_trains_in_one_worker():
    from postrl.config.dpo import DPORunConfig

    with pytest.raises(ValueError, match="scheduler.train.workers=2: postrl dpo trains in one worker"):
        DPORunConfig.model_validate(
            {"data": {"train_files": ["p.jsonl"]}, "model": {"path": "m"}, "scheduler": {"train": {"workers": 2}}}
        )


def test_preference_pairs_from_parquet_name_the_row(tmp_path, char_tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "pairs.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}, {"prompt": "", "chosen": "4", "rejected": "5"}]
        ),
        path,
    )
    with pytest.raises(DatasetError, match=f"{path}:row 2: 'prompt' must be a non-empty string"):
        load_preference_pairs([str(path)], char_tokenizer, max_tokens=64)
    pairs, skipped = load_preference_pairs([str(path)], char_tokenizer, max_tokens=64, on_bad_row="skip")
    assert len(pairs) == 1 and pairs[0].source == f"{path}:row 1" and len(skipped) == 1


@pytest.mark.slow
def test_postrl_dpo_stops_cleanly_on_ctrl_c_and_resumes(tmp_path, tiny_model_dir):
    import os
    import signal
    import subprocess
    import sys

    from tests.test_run_dir import REPO, _wait_for_line

    rows = [{"prompt": f"{a}+{a}=", "chosen": str(2 * a), "rejected": str(2 * a + 1)} for a in range(10, 90)]
    data = write(tmp_path / "pairs.jsonl", rows)
    config = tmp_path / "dpo.yaml"
    config.write_text(
        f"name: d\noutput_dir: {tmp_path}/runs\nmodel: {{path: {tiny_model_dir}}}\n"
        f"data: {{train_files: [{data}]}}\ntrain: {{lr: 1.0e-3, mini_batch_size: 2, micro_batch_size: 2}}\n"
        "epochs: 50\ncheckpoint: {every_steps: 0, keep_last: 1}\nlogging: {trackers: [jsonl]}\n"
    )
    env = {**os.environ, "PYTHONPATH": REPO}
    command = [sys.executable, "-m", "postrl.cli", "dpo"]
    proc = subprocess.Popen([*command, str(config)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_line(proc, "step 2/")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    run = tmp_path / "runs" / "d"
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert proc.returncode == 128 + signal.SIGINT and "Traceback" not in err, err
    assert (
        f"stopped after step {last}; the last checkpoint is step {last}. Resume with: postrl dpo --resume {run}" in err
    )
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step_{last:08d}"]
    done = subprocess.run(
        [*command, "--resume", str(run), "epochs=1"], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert last < 40 and done.returncode == 0, done.stderr  # one epoch is 40 steps: the resume finishes it
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 41))
