"""Attention dropout from a counter-based generator: the PyTorch statement of what every kernel draws.

No dropout mask is ever stored. The keep decision of the pair ``(b, h, m, n)`` (``h`` the query head)
is a pure function of a 64-bit seed and the pair's position, so the backward regenerates exactly the
mask of the forward, and every backend (reference, C++, Triton, CUDA) drops the same pairs:

* counter ``e = ((b·Hq + h)·L + m)·S + n`` (64 bits), split into the Philox counter
  ``(e mod 2³², e div 2³², 0, 0)``; key ``(seed mod 2³², (seed div 2³²) mod 2³²)``;
* Philox4x32 with 10 rounds (Salmon et al., SC'11) — the generator of Triton's ``tl.randint``;
  the random word is its first output;
* the pair is **kept** iff ``word ≥ floor(p · 2³²)``, so the keep rate is ``1 − p`` up to 2⁻³²;
  kept probabilities are scaled by ``1 / (1 − p)``, as ``torch.nn.functional.dropout`` does.

The seed is drawn from torch's default generator once per call (:func:`draw_seed`), so results are
reproducible under ``torch.manual_seed``. Under ``torch.func.vmap`` that draw follows vmap's
``randomness``: one seed for every element (``"same"``), one per element (``"different"``), an error
(``"error"``, vmap's default). The masks here take the seed as a tensor too, so that the composite
(higher derivatives, ``torch.func`` transforms) draws each vmapped element's mask from its own seed.
"""
from __future__ import annotations

from typing import Tuple, Union

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10


def _mul_hi_lo(a: Tensor, constant: int) -> Tuple[Tensor, Tensor]:
    """High and low 32 bits of ``a · constant`` for ``a`` in [0, 2³²) held in int64 (the full product
    would overflow int64, so ``constant`` is split into 16-bit halves)."""
    c_hi, c_lo = constant >> 16, constant & 0xFFFF
    low_part = a * c_lo  # < 2⁴⁸
    t = a * c_hi + (low_part >> 16)  # a · constant = t · 2¹⁶ + (low_part mod 2¹⁶)
    return t >> 16, ((t & 0xFFFF) << 16) | (low_part & 0xFFFF)


Seed = Union[int, Tensor]


def philox4x32(key: Tuple[Seed, Seed], counter: Tuple[Tensor, Tensor, Tensor, Tensor]) -> Tuple[Tensor, ...]:
    """Philox4x32-10 of 32-bit words held in int64 tensors; returns the four output words. The key words
    are ints or int64 tensors broadcastable to the counters."""
    k0, k1 = key[0] & _MASK32, key[1] & _MASK32
    c0, c1, c2, c3 = counter
    for _ in range(ROUNDS):
        hi_b, lo_b = _mul_hi_lo(c2, _ROUND_B)
        hi_a, lo_a = _mul_hi_lo(c0, _ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _MASK32, (k1 + _KEY_B) & _MASK32
    return c0, c1, c2, c3


def philox_words(seed: Seed, counters: Tensor) -> Tensor:
    """The first Philox4x32-10 output word of each 64-bit counter (int64 tensor), as int64 in [0, 2³²).
    ``seed``: an int, or a one-element int64 tensor (read as a tensor, never as a Python number, so that
    a seed that is batched under ``torch.func.vmap`` gives each element its own words)."""
    seed = seed.reshape(()) if isinstance(seed, Tensor) else int(seed)
    zero = torch.zeros_like(counters)
    words = philox4x32((seed & _MASK32, (seed >> 32) & _MASK32),
                       (counters & _MASK32, (counters >> 32) & _MASK32, zero, zero))
    return words[0]


def keep_threshold(dropout_p: float) -> int:
    """The smallest kept word: ``floor(p · 2³²)`` (computed in double precision, as the kernels do)."""
    return int(float(dropout_p) * 4294967296.0)


def pair_counters(b: Tensor, h: Tensor, m: Tensor, n: Tensor, heads: int, queries: int, keys: int) -> Tensor:
    """Counters ``((b·Hq + h)·L + m)·S + n`` of broadcastable int64 index tensors."""
    return ((b * heads + h) * queries + m) * keys + n


def keep_mask(seed: Seed, dropout_p: float, shape: Tuple[int, int, int, int], key_start: int = 0,
              key_count: int = -1, device=None) -> Tensor:
    """Bool ``[B, Hq, L, n]`` keep mask of the keys ``[key_start, key_start + n)`` of a ``[B, Hq, L, S]`` call."""
    B, H, L, S = shape
    count = S - key_start if key_count < 0 else key_count
    index = dict(dtype=torch.int64, device=device)
    b = torch.arange(B, **index).view(B, 1, 1, 1)
    h = torch.arange(H, **index).view(1, H, 1, 1)
    m = torch.arange(L, **index).view(1, 1, L, 1)
    n = torch.arange(key_start, key_start + count, **index).view(1, 1, 1, count)
    return philox_words(seed, pair_counters(b, h, m, n, H, L, S)) >= keep_threshold(dropout_p)


def draw_seed() -> Tensor:
    """A fresh 63-bit seed from torch's default CPU generator, as the one-element int64 tensor the
    kernels take (a tensor, not a Python int, so that compiled graphs do not specialise on it)."""
    return torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64)
