"""Loading Hugging Face causal LMs and tokenizers (a local folder, a hub id, or the shipped demo model)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

DEMO_MODEL_DIR = Path(__file__).resolve().parent / "tasks" / "demo_model"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_model_path(path: str) -> str:
    if path == "demo":
        if not (DEMO_MODEL_DIR / "config.json").is_file():
            raise FileNotFoundError(
                f"the demo model is missing from {DEMO_MODEL_DIR}; rebuild it with scripts/build_demo_model.py"
            )
        return str(DEMO_MODEL_DIR)
    expanded = os.path.expanduser(path)
    return expanded if os.path.exists(expanded) else path


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(path: str, dtype: str = "float32") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(path), dtype=DTYPES[dtype])
    return model
