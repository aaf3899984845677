"""A seeded permutation of [0, n) computed on the fly, vectorized over index arrays.

A converted corpus holds ~10^8 documents per bucket: a materialized permutation would cost
~800 MB per host and per epoch, and would have to be rebuilt on every restore. Instead the
position -> document map is a balanced Feistel network over [0, 2^k) (a bijection for any
round function), restricted to [0, n) by cycle walking: a value that lands outside [0, n) is
mapped again until it lands inside. Cycle walking keeps the bijection (it follows each cycle
of the larger permutation to its next member in range), and with 2^k < 4n at most a few
extra rounds are needed on average. O(1) memory and state: (n, seed words).
"""
from __future__ import annotations

import numpy as np

ROUNDS = 6
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """splitmix64's finalizer of (x + key): every output bit depends on every input bit."""
    z = (x + key) * _GOLDEN
    z ^= z >> np.uint64(30)
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    return z ^ (z >> np.uint64(31))


class FeistelPermutation:
    """perm(i) for i in [0, n): a bijection of [0, n) drawn by `seed` (a list of ints, e.g.
    [run seed, epoch])."""

    def __init__(self, n: int, seed: list[int]):
        if n < 1:
            raise ValueError(f"a permutation of {n} elements")
        self.n = int(n)
        bits = max(2, (self.n - 1).bit_length())
        bits += bits % 2                      # two equal halves
        self.half = np.uint64(bits // 2)
        self.mask = np.uint64((1 << (bits // 2)) - 1)
        words = np.random.default_rng([*map(int, seed), 0xFE157E1]).integers(
            0, 2**63, size=ROUNDS, dtype=np.uint64)
        self.keys = [np.uint64(w) for w in words]

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right, key) & self.mask)
        return (left << self.half) | right

    def __call__(self, idx: np.ndarray) -> np.ndarray:
        """idx: int array of positions in [0, n) -> int64 array of the elements there."""
        x = np.asarray(idx, np.uint64)
        with np.errstate(over="ignore"):   # uint64 arithmetic wraps on purpose
            y = self._feistel(x)
            out = y >= self.n
            while out.any():
                y[out] = self._feistel(y[out])
                out = y >= self.n
        return y.astype(np.int64)
