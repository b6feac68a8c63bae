"""What one request to ``postrl serve-rollout`` may ask for (its own module: the CLI's parser takes
its defaults from here without importing the server)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask for; larger requests get a 400 naming the bound."""

    max_n: int = 64
    max_tokens: int = 4096
    max_prompts: int = 64
    default_max_tokens: int = 256
    weights_dir: str | None = None  # /update_weights reads only files under it; None disables it
    max_body_bytes: int = 4 << 20
