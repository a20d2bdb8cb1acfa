"""Stable integer hashing for the engine's keyed randomness (init and dropout keys)."""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def mix(*values: int) -> int:
    """Stable 63-bit hash of integers (splitmix64 chain); seeds generators and dropout keys."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (int(v) & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        z = h
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        h = z ^ (z >> 31)
    return h & ((1 << 63) - 1)


__all__ = ["mix"]
