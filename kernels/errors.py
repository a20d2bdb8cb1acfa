"""The one error type of :mod:`plora.kernels`, so the package is usable without the rest of plora."""

from __future__ import annotations


class PackedLoRAError(ValueError):
    """A bad argument of a packed LoRA call (shape, dtype, slot table, backend).

    ``str(err)`` is one line naming the argument, the bad value and what to pass instead.
    """


__all__ = ["PackedLoRAError"]
