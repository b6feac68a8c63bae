"""Freed host memory kept in the process, for the next tensor of the same size.

glibc's ``malloc`` serves a block above its mmap threshold (128 KB, raised as such blocks are
freed, to at most 32 MB) with a fresh ``mmap`` and returns it to the OS when freed, and it trims
its heap's free top above twice that. A training step allocates and frees the same large tensors
over and over (a 128-row tile of a 49k vocabulary's logits is 25 MB), so each allocation is
first-touch page faults again: on 2 CPU cores a fifth of SmolLM2's micro-batch (bf16: 1.67 s ->
1.42 s for the lean forward and backward, 2.71 s -> 1.92 s for the exact one). Kept in the heap,
a freed block is reused without faults. The cost is a resident size that stays at its peak, and
climbs past it when the sizes keep changing: generation and training on agent episodes, whose
lengths all differ, fragment the kept blocks (an ``agent.function`` GRPO run on SmolLM2 with a
float32 engine: 3.6 -> 8.9 GB over one update, 22.5 GB at step 2, then the OOM killer). So the
train worker and the native engine give the free pages back once their update or decode loop is
done (:func:`return_freed_memory`): within it, blocks are still reused; the same run then stayed
at 3.6-4.0 GB between steps.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
from collections.abc import Callable

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's mallopt parameters
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks up to this come from the heap
TRIM_THRESHOLD = 1 << 30  # free memory at the heap's top kept, up to this
TOP_PAD = 64 << 20  # extra heap asked for at each growth


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's ``malloc`` to keep freed blocks of up to 32 MB (and up to 1 GB of free heap
    top) for reuse. Once per process; False where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD))
    applied = all(mallopt(param, value) == 1 for param, value in settings)
    if not applied:
        log.debug("malloc settings not applied; freed host memory goes back to the OS as usual")
    return applied


def return_freed_memory() -> bool:
    """Give the heap's free pages back to the OS (glibc ``malloc_trim(0)``): after an update or a
    decode loop, whose blocks the next one will not reuse in the same sizes. False where the C
    library is not glibc."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
