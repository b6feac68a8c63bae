"""Loading Hugging Face causal LMs and tokenizers (a local folder, a hub id, or the shipped demo model),
and writing model folders that every postrl command and ``from_pretrained`` can load back."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any

import torch

from postrl.config.run import ConfigError

DEMO_MODEL_DIR = Path(__file__).resolve().parent.parent / "tasks" / "demo_model"
AGENTIC_MODEL_DIR = Path(__file__).resolve().parent.parent / "tasks" / "agentic_model"
# the models shipped in the package, by the name a config uses, with the script that rebuilds each
SHIPPED_MODELS = {
    "demo": (DEMO_MODEL_DIR, "scripts/build_demo_model.py"),
    "agentic-demo": (AGENTIC_MODEL_DIR, "scripts/build_agentic_model.py"),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# decoder-only models whose logits are exactly lm_head(decoder(x)): the native engine runs them, and
# training projects to the vocabulary only at trained positions
PLAIN_HEAD_MODEL_TYPES = ("llama", "qwen2", "mistral")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")


class ModelNotFoundError(ConfigError):
    """A model path that is neither a model folder nor a loadable model id."""


def hf(model: torch.nn.Module) -> Any:
    """A transformers (or peft) model as what it is: its methods (``get_output_embeddings``,
    ``save_pretrained``, ``disable_adapter``, ...) come from the library, which ``torch.nn.Module``
    does not declare."""
    return model


def resolve_model_path(path: str) -> str:
    """The folder to load ``path`` from (``demo``, ``agentic-demo``: the shipped models), or ``path``
    itself when it can only be a hub id. A path that is neither fails here, in one line."""
    if path in SHIPPED_MODELS:
        folder, script = SHIPPED_MODELS[path]
        if not (folder / "config.json").is_file():
            raise ModelNotFoundError(f"the {path} model is missing from {folder}; rebuild it with {script}")
        return str(folder)
    expanded = os.path.expanduser(path)
    if os.path.isdir(expanded):
        if not os.path.isfile(os.path.join(expanded, "config.json")):
            raise ModelNotFoundError(f"{path} is a folder but not a model folder (it has no config.json)")
        return expanded
    if os.path.exists(expanded) or not _HUB_ID.match(path) or path.count("/") > 1:
        raise ModelNotFoundError(f"no model folder at {path}, and {path} is not a model id")
    _check_hub_id(path)
    return path


@functools.lru_cache(maxsize=32)
def _check_hub_id(model_id: str) -> None:
    """Fail in one line, within seconds, for a name that is neither cached nor on the hub (instead of
    transformers' minute of retries and a long traceback)."""
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(model_id, "config.json"), str):
        return
    missing = f"no model folder at {model_id}, and {model_id} is not a model id"
    if constants.HF_HUB_OFFLINE:
        raise ModelNotFoundError(f"{missing} in the local Hugging Face cache (HF_HUB_OFFLINE is set)")
    import httpx

    try:
        answer = httpx.head(f"{constants.ENDPOINT}/api/models/{model_id}", timeout=5.0, follow_redirects=True)
    except httpx.HTTPError as exc:
        raise ModelNotFoundError(
            f"{missing} in the local Hugging Face cache, and the hub cannot be reached ({type(exc).__name__})"
        ) from None
    if answer.status_code in (401, 404):
        raise ModelNotFoundError(missing)


def _load(loader: Any, path: str, **kwargs: Any) -> Any:
    resolved = resolve_model_path(path)
    try:
        return loader.from_pretrained(resolved, **kwargs)
    except OSError as exc:
        if resolved != path or os.path.isdir(resolved):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelNotFoundError(
            f"no model folder at {path}, and {path} is not a model id that loads: {first}"
        ) from None


def quiet_transformers() -> None:
    """transformers' per-file progress bars drown the step lines (also from worker processes, which
    call this when they start); warnings and errors still show."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    tokenizer = _load(AutoTokenizer, path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(path: str, dtype: str = "float32") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return _load(AutoModelForCausalLM, path, dtype=DTYPES[dtype])


def context_length(path: str) -> int | None:
    """The model's maximum sequence length from its config, when it declares one."""
    from transformers import AutoConfig

    config = _load(AutoConfig, path)
    return getattr(config, "max_position_embeddings", None)
