"""``postrl dpo``: validate, cache the reference log-probabilities once, train over the pairs,
checkpoint, resume, save the final model. Shares the run directory handling, the lease, the
metric sinks, the checkpoints and the Train Worker with ``postrl train``."""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from postrl.config.dpo import DPORunConfig
from postrl.config.run import ConfigError, save_config
from postrl.data.preferences import PreferencePair, load_preference_pairs
from postrl.models.devices import resolve_device
from postrl.models.loading import load_causal_lm, load_tokenizer
from postrl.run.checkpoint import latest_checkpoint, list_checkpoints, load_run_state, save_checkpoint
from postrl.run.lease import RunLease
from postrl.run.place import RunPlace
from postrl.run.train_runner import make_sinks
from postrl.train.dpo import DPOWorker
from postrl.train.lr_schedule import default_decay_steps
from postrl.types import StepMetrics

REFERENCE_FILE = "reference_logprobs.pt"


def reference_logprobs(config: DPORunConfig, pairs: list[PreferencePair], pad_id: int, run_dir: Path) -> torch.Tensor:
    """The starting model's (chosen, rejected) log-probabilities, computed once per run and cached in
    the run directory (a resumed run reads them back: its policy is no longer the reference)."""
    path = run_dir / REFERENCE_FILE
    if path.is_file():
        cached = torch.load(path, weights_only=True)
        if cached["sources"] == [p.source for p in pairs]:
            return cached["logprobs"]
    device = resolve_device(config.train.device, "train.device")
    reference = load_causal_lm(config.model.path, config.model.dtype).to(device)
    worker = DPOWorker(reference, config.train, config.dpo, pad_id, seed=config.seed)
    logprobs = worker.reference_logprobs(pairs)
    torch.save({"sources": [p.source for p in pairs], "logprobs": logprobs}, path)
    return logprobs


def pair_order(n: int, seed: int, epoch: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()


def train_dpo(config: DPORunConfig, resume: bool = False, overwrite: bool = False, echo=print) -> DPOWorker:
    place = RunPlace(config)
    if resume:
        place.check_resumable()
    else:
        place.check_new(overwrite, command="dpo")
    tokenizer = load_tokenizer(config.model.path)
    pairs, skipped = load_preference_pairs(
        config.data.train_files, tokenizer, config.data.max_tokens, config.data.on_bad_row
    )
    default_decay_steps(config.train, config.epochs * math.ceil(len(pairs) / config.train.mini_batch_size))
    lease = RunLease(place.location)
    lease.check_free()
    if not resume and overwrite:
        place.move_aside()
    place.prepare(resume)
    lease.acquire(echo)
    try:
        return _train(config, place, tokenizer, pairs, skipped, resume, echo)
    finally:
        lease.release()


def _train(config: DPORunConfig, place: RunPlace, tokenizer, pairs, skipped, resume: bool, echo) -> DPOWorker:
    run_dir = config.run_dir
    if skipped:
        (run_dir / "skipped_rows.txt").write_text("".join(line + "\n" for line in skipped))
        echo(f"skipped {len(skipped)} bad pairs (data.on_bad_row=skip); listed in {run_dir / 'skipped_rows.txt'}")
    reference = reference_logprobs(config, pairs, tokenizer.pad_token_id, run_dir)
    device = resolve_device(config.train.device, "train.device")
    worker = DPOWorker(
        load_causal_lm(config.model.path, config.model.dtype).to(device),
        config.train,
        config.dpo,
        tokenizer.pad_token_id,
        seed=config.seed,
        gradient_checkpointing=config.model.gradient_checkpointing,
    )
    mini = config.train.mini_batch_size
    per_epoch = math.ceil(len(pairs) / mini)
    total, step = config.epochs * per_epoch, 0
    if resume:
        checkpoint = latest_checkpoint(run_dir)
        if checkpoint is None:
            raise FileNotFoundError(f"no complete checkpoint under {run_dir / 'checkpoints'} to resume from")
        worker.load_checkpoint(checkpoint)
        step = int(load_run_state(checkpoint)["step"])
        if total < step:
            raise ConfigError(
                f"epochs={config.epochs} gives {total} steps, below the {step} this run has already "
                "done; a resume can only continue it"
            )
        echo(f"resumed {place.location} from step {step} ({checkpoint})")
    save_config(config, run_dir / "config.yaml")  # type: ignore[arg-type]
    sinks = make_sinks(config, run_dir, step if resume else None, echo, total=total)  # type: ignore[arg-type]
    try:
        while step < total:
            began = time.perf_counter()
            order = pair_order(len(pairs), config.seed, step // per_epoch)
            chosen = order[(step % per_epoch) * mini : (step % per_epoch + 1) * mini]
            values = worker.update_pairs([pairs[i] for i in chosen], reference[chosen])
            step += 1
            values.update({"data/epoch": float((step - 1) // per_epoch), "time/step_s": time.perf_counter() - began})
            for sink in sinks:
                sink.write(StepMetrics(step=step, weight_version=step, values=values))
            every = config.checkpoint.every_steps
            if step == total or (every and step % every == 0):
                path = save_checkpoint(
                    run_dir,
                    step,
                    worker,
                    {"step": step, "weight_version": step},
                    config.checkpoint.keep_last,
                    tokenizer,
                )
                place.publish_checkpoint(path, list_checkpoints(run_dir))
        final = run_dir / "final_model"
        worker.save_pretrained(final)
        tokenizer.save_pretrained(final)
        echo(f"trained model: {final}")
    finally:
        for sink in sinks:
            sink.close()
    place.publish("final_model", "metrics.jsonl", "tensorboard", REFERENCE_FILE)
    return worker
