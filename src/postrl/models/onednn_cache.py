"""How many oneDNN primitives torch's CPU kernels keep, set before the first one is made.

oneDNN (torch's CPU matmul library) keeps each primitive it made, keyed by the operation's shapes,
up to ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` (1024 by default); a bf16 primitive on a CPU with AMX
holds its own reordered copy of the weight. Training on agent episodes, whose lengths all differ,
makes a new shape almost every call: an ``agent.function`` run on SmolLM2 grew ~2 GB a step
(8.9 -> 18.8 GB in 7 steps, then the OOM killer) while its live tensors stayed flat; with the
cache capped at 8 it stayed flat (7.54 -> 7.58 GB from step 2 to 3) at the same step time. oneDNN
reads the variable when it makes its first primitive, so setting it after torch is imported but
before its first matmul still counts (one weight, 400 bf16 matmul shapes: +295 MB unset, +162 MB
set before torch is imported, +180 MB after). A user's own setting is left as it is.
"""

from __future__ import annotations

import os

CAPACITY = "8"


def bound_onednn_cache() -> bool:
    """Set ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` for this process and its children unless the user
    set it; True when it was set."""
    if "ONEDNN_PRIMITIVE_CACHE_CAPACITY" in os.environ:
        return False
    os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = CAPACITY
    return True
