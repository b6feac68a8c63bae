"""A LoRA adapter folder merged into its base model: a plain Hugging Face folder every postrl command,
every engine and ``from_pretrained`` loads (``postrl merge-lora``).

postrl's source tree ships one adapter: ``smollm2-tools``, the tool-calling warm start of
SmolLM2-135M-Instruct (``scripts/build_tool_adapter.py`` rebuilds it), whose base is the SmolLM2
folder ``postrl convert-gguf smollm2`` writes to the cache. Its weights are data, not code: they
live in ``assets/tool_adapter/`` beside the package's sources, not inside the package.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from postrl.config.run import ConfigError

TOOL_ADAPTER_DIR = Path(__file__).resolve().parents[3] / "assets" / "tool_adapter"  # in a source checkout


def _smollm2() -> str:
    from postrl.models.gguf import smollm2_dir

    return str(smollm2_dir())


# a shipped adapter's name -> (its folder, the function giving its base model's folder, its build script)
SHIPPED_ADAPTERS: dict[str, tuple[Path, Callable[[], str], str]] = {
    "smollm2-tools": (TOOL_ADAPTER_DIR, _smollm2, "scripts/build_tool_adapter.py"),
}


def adapter_folder(adapter: str) -> Path:
    """The folder of a shipped adapter (by name) or of an adapter given as a folder."""
    if adapter in SHIPPED_ADAPTERS:
        folder, _, script = SHIPPED_ADAPTERS[adapter]
        if not (folder / "adapter_config.json").is_file():
            raise ConfigError(
                f"the {adapter} adapter is missing from {folder}: it ships with postrl's source checkout "
                f"(assets/tool_adapter/, an editable install as the README's setup makes); rebuild it with {script}"
            )
        return folder
    folder = Path(adapter).expanduser()
    if not (folder / "adapter_config.json").is_file():
        raise ConfigError(
            f"{adapter} is not a LoRA adapter folder (no adapter_config.json) nor a shipped adapter "
            f"({', '.join(SHIPPED_ADAPTERS)})"
        )
    return folder


def base_of_adapter(adapter: str, folder: Path) -> str:
    """The base model an adapter was trained on: a shipped adapter's own, else its config's."""
    if adapter in SHIPPED_ADAPTERS:
        return SHIPPED_ADAPTERS[adapter][1]()
    base = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base:
        raise ConfigError(f"{folder}/adapter_config.json names no base_model_name_or_path: give --base")
    return str(base)


def merge_adapter(adapter: str, out_dir: str | Path, base: str | None = None) -> Path:
    """Write ``base`` (default: the adapter's own base) with ``adapter`` merged into its weights, in
    float32, with the base's tokenizer and chat template, to ``out_dir``."""
    from peft import PeftModel

    from postrl.models.loading import load_causal_lm, load_tokenizer, resolve_model_path

    folder = adapter_folder(adapter)
    base_path = resolve_model_path(base or base_of_adapter(adapter, folder))
    model = PeftModel.from_pretrained(load_causal_lm(base_path, "float32"), str(folder)).merge_and_unload()
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    load_tokenizer(base_path).save_pretrained(out)
    return out
