"""Per-sample random streams: every sample draws its tokens from a stream of its own, named by where
it comes from, never from a generator that the samples batched with it also draw from.

A stream is a 62-bit key. The run's prompt draw names each drawn prompt's stream from the run's
seed and the prompt's place in the draw (``Prompt.stream``); sample ``k`` of a prompt, turn ``t`` of
an episode, each derive their own from it (:func:`derive`). The uniforms a sample's token at
position ``p`` is drawn with are a hash of (key, p) (:func:`uniforms`): counter-based, as Philox
is, so the same sample gets the same tokens whatever else is in the batch, whatever order the
requests joined in, and however many threads the process runs: individually scheduled episodes
reproduce as lockstep ones do.

The hash is 32-bit arithmetic carried in int64 tensors, the products split so that nothing
overflows, so it gives the same numbers on every device.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1
KEY_BITS = 62


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derive(key: int, *parts: int) -> int:
    """The stream of a part of ``key``'s (its sample ``k``, its turn ``t``...): a 62-bit key. The
    integers are taken modulo 2**64 (a negative seed names a stream too)."""
    x = key & _MASK64
    for part in parts:
        x = _splitmix64(x ^ _splitmix64((part + 1) & _MASK64))
    return _splitmix64(x) >> (64 - KEY_BITS)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for ``0 <= x < 2**32`` in int64 without overflow: 16-bit halves."""
    hi, lo = x >> 16, x & 0xFFFF
    return ((((hi * c) & 0xFFFF) << 16) + lo * c) & 0xFFFFFFFF


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32) of each entry of ``x`` (values < 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniforms(keys: torch.Tensor, positions: torch.Tensor, lanes: int = 2) -> torch.Tensor:
    """``[rows, lanes]`` float32 uniforms in [0, 1): row ``i``'s are a function of ``keys[i]`` and
    ``positions[i]`` alone (int64 tensors, keys from :func:`derive`, positions >= 0)."""
    keys, positions = keys.long().unsqueeze(-1), positions.long().unsqueeze(-1)
    lane = torch.arange(lanes, device=keys.device, dtype=torch.long).unsqueeze(0)
    high, low = (keys >> 31) & 0x7FFFFFFF, keys & 0x7FFFFFFF
    counter = (positions * lanes + lane) & 0xFFFFFFFF
    h = _hash32(counter ^ _hash32(low ^ _hash32(high)))
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def draw_key(generator: torch.Generator) -> int:
    """A stream key drawn from ``generator`` (for a sample nobody named a stream for)."""
    return int(torch.randint(0, 1 << KEY_BITS, (1,), generator=generator, device=generator.device).item())


def prompt_key(stream: int | None, seed: int | None, index: int, generator: torch.Generator) -> int:
    """The stream of a prompt in a ``generate`` call: its own (``Prompt.stream``, named by the run's
    draw); else, for a call with a ``seed``, the seed's ``index``-th (the OpenAI ``seed``: the same
    call gives the same samples, whatever it is batched with); else one drawn from ``generator``
    (the engine's, saved in its checkpoint: reproducible where calls come in a fixed order)."""
    if stream is not None:
        return stream
    if seed is not None:
        return derive(seed, index)
    return draw_key(generator)
