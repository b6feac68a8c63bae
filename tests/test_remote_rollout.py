"""A training run whose rollouts come from running OpenAI-compatible servers by URL: two
`serve-rollout` servers behind the router; every weight sync reaches both."""

from __future__ import annotations

import json

import httpx
import torch

from postrl.config.loading import build_config
from postrl.models.loading import load_causal_lm, load_tokenizer
from postrl.rollout.native import NativeRolloutWorker
from postrl.run.train_runner import train
from postrl.serve.batcher import EngineBatcher
from postrl.serve.limits import ServerLimits
from postrl.serve.openai_server import build_app
from postrl.serve.router import LeastOutstandingRouter, build_router_app
from tests.test_serve import Server


def test_run_trains_with_rollouts_from_servers_behind_the_router(tmp_path, tiny_model_dir, arithmetic_jsonl):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    weights = tmp_path / "weights"
    weights.mkdir()
    engines, servers = [], []
    for seed in (0, 1):
        batcher = EngineBatcher(NativeRolloutWorker.from_hf(load_causal_lm(str(tiny_model_dir)), tokenizer, seed=seed))
        engines.append(batcher)
        limits = ServerLimits(default_max_tokens=8, weights_dir=str(weights))
        servers.append(Server(build_app(batcher, tokenizer, "tiny", max_context=128, limits=limits)))
    router = Server(build_router_app(LeastOutstandingRouter([s.url for s in servers])))
    try:
        config = build_config(
            {
                "name": "remote",
                "output_dir": str(tmp_path),
                "steps": 2,
                "prompts_per_step": 4,
                "model": {"path": str(tiny_model_dir)},
                "data": {"train_files": [str(arithmetic_jsonl)]},
                "rollout": {"backend": "openai", "url": router.url, "sync_dir": str(weights), "n": 4, "max_tokens": 8},
                "reward": {
                    "components": [{"type": "custom", "name": "digits", "function": "tests.reward_fns:digit_share"}]
                },
                "train": {"lr": 1e-2, "mini_batch_size": 16, "micro_batch_size": 8},
                "logging": {"trackers": ["jsonl"]},
            }
        )
        controller = train(config).controller
        assert controller.step_count == 2
        rows = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
        # the servers' logprobs are the policy's: they agree with the trainer's recomputation
        assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in rows)
        # both backends took every sync and now hold the trained weights
        assert [b.worker.weight_version for b in engines] == [2, 2]
        final = load_causal_lm(str(config.run_dir / "final_model")).state_dict()
        for b in engines:
            assert torch.equal(b.worker.model.params["model.norm.weight"], final["model.norm.weight"])
        assert httpx.get(router.url + "/health").status_code == 200
    finally:
        router.stop()
        for s in servers:
            s.stop()
        for b in engines:
            b.close()
