"""Shared fixtures: tiny random models built from configs, a char tokenizer, small datasets."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from postrl.tasks.char_tokenizer import build_char_tokenizer

if os.environ.get("PYTEST_XDIST_WORKER"):  # the cores shared between the workers, not each taking them all
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

# Every process a test process starts (a Ray instance's included) inherits this mark, so that a test
# counts its own Ray processes and not another xdist worker's (tests/test_ray.py: ray_processes).
TEST_PROCESS_MARK = "POSTRL_TEST_PROCESS"
os.environ[TEST_PROCESS_MARK] = f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}"
# Ray's own files apart for each worker: ray.init() joins the cluster named in its temp folder's
# ray_current_cluster (a test's ray.cluster_utils.Cluster writes one), which must be this worker's
os.environ["RAY_TMPDIR"] = f"/tmp/postrl-ray-{os.environ[TEST_PROCESS_MARK]}"


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def char_tokenizer():
    return build_char_tokenizer()


def make_tiny_model(kind: str, tokenizer, seed: int = 0, max_positions: int = 128):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **common)).eval()
    return Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=False, **common)).eval()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, char_tokenizer) -> Path:
    """A tiny random Llama saved as a Hugging Face folder (safetensors + tokenizer)."""
    out = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_model("llama", char_tokenizer).save_pretrained(out, safe_serialization=True)
    char_tokenizer.save_pretrained(out)
    return out


@pytest.fixture
def arithmetic_jsonl(tmp_path) -> Path:
    path = tmp_path / "train.jsonl"
    rows = [
        {"prompt": f"{a}+{b}=", "answer": str(a + b), "task_type": "add"} for a in range(10, 14) for b in range(20, 24)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def hf_greedy(model, tokenizer, text: str, max_new_tokens: int) -> tuple[list[int], str]:
    """transformers' greedy continuation of ``text``: the whole token sequence (up to and including
    EOS) and why it stopped, as a rollout engine must report them."""
    ids = torch.tensor([tokenizer(text)["input_ids"]], device=model.device)
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    new = out[0, ids.shape[1] :].tolist()
    eos = tokenizer.eos_token_id
    return (new[: new.index(eos) + 1], "stop") if eos in new else (new, "length")


def seqs(rollouts) -> list[tuple[int, list[int], str]]:
    """What a parity test compares: each response's prompt, its whole token sequence, and why it stopped."""
    return [(r.prompt_index, r.response_ids, r.finish_reason) for r in rollouts]


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: a worker per core, at most 4 (each holds its own models and torch threads). One
    more worker than cores was slower on 2 cores (17:39 against 16:46 for the full suite)."""
    return max(1, min(os.cpu_count() or 1, 4))


def in_group(item: pytest.Item, group: str) -> None:
    """``item`` in xdist group ``group``: xdist's loadgroup sends the tests whose id ends in
    ``@group`` to one worker. pytest 9.2 keeps a structured id that xdist 3.8's own renaming (of
    ``_nodeid``) no longer reaches, so the id is renamed here (once: not where xdist did it)."""
    item.add_marker(pytest.mark.xdist_group(group))
    if os.environ.get("PYTEST_XDIST_WORKER") and item.config.getvalue("loadgroup") and "@" not in item.nodeid:
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(f"{item.nodeid}@{group}")


@pytest.hookimpl(trylast=True)  # after xdist's own renaming, where it still works
def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA; without it they are skipped with the reason (never silently
    passed). Tests marked ``serial`` (Ray clusters, looks at every process of the machine) all run
    on one xdist worker, one after another; so do those of one ``xdist_group``."""
    for item in items:
        if "serial" in item.keywords:
            in_group(item, "serial")
        elif (group := item.get_closest_marker("xdist_group")) is not None:
            in_group(item, group.kwargs.get("name", group.args[0] if group.args else "default"))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA device; torch {torch.__version__} sees none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def model_and_tokenizer():
    """A tiny random Llama with the Qwen2.5-style chat template, 1024 positions (episode tests)."""
    from tests.chat_templates import family_tokenizer

    tokenizer = family_tokenizer("qwen2.5")
    model = make_tiny_model("llama", tokenizer)
    model.config.max_position_embeddings = 1024
    return model, tokenizer
