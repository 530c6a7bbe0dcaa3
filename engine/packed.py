"""PackedWeight: one weight in the kernels' layout, what every format reader yields and the runtime uploads.

Neutral ground between engine/formats (which produce it) and the runtime (which consumes it), so neither
imports the other for it.
"""

from __future__ import annotations


class PackedWeight(dict):
    """One canonical weight: {array name: array} in our layout, plus what the runtime needs to run it."""

    def __init__(self, arrays: dict, format: str, shape: tuple[int, ...], sources: tuple[str, ...]):
        super().__init__(arrays)
        self.format = format  # a tag of engine/matmul.py FORMATS: "q4_0", "mlx4", "f16", "f32", ...
        self.shape = shape  # logical shape: (N, K) for matrices, (..., N, K) for stacks, (D,) for vectors
        self.sources = sources  # the checkpoint tensors it was built from, in row order
