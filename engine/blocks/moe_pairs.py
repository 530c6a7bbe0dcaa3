"""Two MoE layers' expert stacks in one buffer, where wgpu's allocator would waste most of a block on each.

A stack of more than half the allocator's largest block (256 MiB: engine/gpu_heap.py) but not more than one goes
into a shared block that nothing else of its size fits beside: Qwen3.6-35B-A3B 4-bit's `down` stacks (128.5 MiB)
leave ~127.5 MiB of each block unused, its 3-bit `gate_up` stacks (193 MiB) ~63 MiB. Two layers' stacks together
are larger than a block, so the pair gets a block of exactly its size. Each layer binds its part as a
(buffer, offset, size) range, so the kernels and the stored formats are unchanged.
"""

from __future__ import annotations

from typing import NamedTuple

from engine.gpu_heap import DEVICE_BLOCKS

# Stack bytes (exclusive, inclusive) that get paired; tests widen it to pair tiny models' stacks.
PAIR_RANGE = (DEVICE_BLOCKS[1] // 2, DEVICE_BLOCKS[1])
PAIRED = (("gate_up", "w"), ("gate_up", "s"), ("down", "w"), ("down", "s"))  # the routed stacks' buffers


class PairPart(NamedTuple):
    """One layer's part of a paired buffer."""

    label: str  # the buffer's (the pair's first layer's label, "+" the second layer)
    offset: int  # where the part starts (a multiple of the device's storage-buffer offset alignment)
    size: int  # the part's bytes
    total: int  # the buffer's bytes
    writes: tuple[int, int]  # the two parts' bytes, in upload order


def pair_stacks(sizes: dict[tuple[int, str, str], int], layers: tuple[int, ...], align: int,
                max_buffer: int | None) -> dict[tuple[int, str, str], PairPart]:
    """(layer, stack, key) -> its PairPart, for the stacks in PAIR_RANGE, paired in layer order (an odd one keeps its
    own buffer); `sizes`: (layer, stack, key) -> the bytes each buffer would have alone."""
    lo, hi = PAIR_RANGE
    out = {}
    for stack, key in PAIRED:
        fits = [i for i in layers if lo < sizes.get((i, stack, key), 0) <= hi and sizes[i, stack, key] % 4 == 0]
        for a, b in zip(fits[0::2], fits[1::2], strict=False):
            na, nb = sizes[a, stack, key], sizes[b, stack, key]
            offset = -(-na // align) * align
            if max_buffer is not None and offset + nb > max_buffer:
                continue
            label = f"layers.{a}.moe.{stack}.{key}+{b}"
            out[a, stack, key] = PairPart(label, 0, na, offset + nb, (na, nb))
            out[b, stack, key] = PairPart(label, offset, nb, offset + nb, (na, nb))
    return out


def view(buf, offset: int, size: int) -> tuple:
    """A (buffer, offset, size) range `offset` bytes into `buf` (a buffer, or itself such a range)."""
    if isinstance(buf, tuple):
        return buf[0], buf[1] + offset, size
    return buf, offset, size
