"""GPU memory as the driver holds it: wgpu's allocator places buffers in blocks of device memory, so a loaded model
holds more than the sum of its buffers. This models that allocator, so memfit can say what a load really takes.

wgpu-native 29 (wgpu-hal's Vulkan backend with MemoryHints::Performance) allocates through gpu-allocator 0.28:
- one pool per memory type: buffers only the GPU reads (STORAGE, UNIFORM) in device-local memory; buffers the host
  writes (wgpu's upload staging copies, MAP_WRITE) in host-visible memory, which a discrete GPU serves from its own
  memory through its BAR where it can; MAP_READ buffers in cached host memory (system RAM on a discrete GPU).
- a buffer larger than its pool's current block size gets a block of its own, of exactly its size. A smaller one
  goes best-fit into the newest block with room, else into a new block. A pool's block size doubles with each block
  it holds: 128 MiB then 256 MiB for device-local memory, 64 MiB then 128 MiB for host-visible memory.
- a block that empties is freed, unless it is the pool's last shared block.
A CPU (software) adapter has one memory type: every buffer shares one host-visible pool. An integrated GPU keeps the
three pools, all of them in system RAM.

So a loaded model holds the unused rest of its blocks (a buffer just over half a block keeps a block to itself but
for what smaller buffers fill in: a MoE model's expert stacks) and the upload pool's last block. In the order a
load makes its buffers this accounts for what an H200 showed beyond them (BENCH.md, issue 20); the runtime makes its
buffers largest first (engine/transformer.py RuntimePlan.reserved), so that order is the plan's, not the checkpoint's.
The model is checked against the real allocator on a software adapter, whose blocks of device memory are visible as
mappings (tests/test_gpu_heap.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.gpu import PROBE_BYTES, flushes_before

MB = 2**20
DEVICE_BLOCKS = (128 * MB, 256 * MB)  # (first, largest) block of a device-local pool
HOST_BLOCKS = (64 * MB, 128 * MB)  # the same for a host-visible pool
ALIGN = 256  # a buffer's offset and size within a block (what discrete GPUs require of storage buffers, at most)
# What an opened device (engine/gpu.py Gpu) already holds in device-local memory: wgpu's zero buffer (for clearing
# memory) and Gpu's two probes; they open the pool's first block before any model is loaded.
WGPU_ZERO_BUFFER = 512 * 1024
OPEN_BUFFERS = (WGPU_ZERO_BUFFER, PROBE_BYTES, PROBE_BYTES)

POOLS = ("device", "upload", "readback")
# which pools are GPU memory, by kind of adapter (DeviceTraits.memory_kind)
COUNTED = {"discrete": ("device", "upload"), "integrated": POOLS, "cpu": POOLS}


def pool_of(how: str) -> str:
    """The pool of a buffer made as engine/blocks BufferNeed.how says ("stage": a staging copy of an upload)."""
    return {"readback": "readback", "staging": "upload", "stage": "upload"}.get(how, "device")


class _Block:
    """One block of device memory: its free chunks (offset, size), placed best-fit."""

    def __init__(self, size: int, dedicated: bool = False):
        self.size, self.dedicated = size, dedicated
        self.free = [] if dedicated else [(0, size)]
        self.used = size if dedicated else 0

    def place(self, size: int) -> tuple[int, int] | None:
        if self.dedicated or size > self.size - self.used:
            return None
        fits = [(n, off) for off, n in self.free if n >= size]
        if not fits:
            return None
        n, off = min(fits)  # the smallest chunk that fits (gpu-allocator's best fit)
        self.free.remove((off, n))
        if n > size:
            self.free.append((off + size, n - size))
        self.used += size
        return off, size

    def release(self, chunk: tuple[int, int]) -> None:
        self.used -= chunk[1]
        merged: list[tuple[int, int]] = []
        for off, n in sorted([*self.free, chunk]):
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((off, n))
        self.free = merged


class Pool:
    """One memory type's blocks, allocated and freed as gpu-allocator does."""

    def __init__(self, first: int, largest: int):
        self.first, self.largest = first, largest
        self.blocks: list[_Block | None] = []
        self.shared = 0  # blocks that take several buffers

    @property
    def held(self) -> int:
        return sum(b.size for b in self.blocks if b is not None)

    def alloc(self, size: int) -> tuple[int, tuple[int, int] | None]:
        """A buffer of `size` bytes: a handle for free()."""
        size = -(-size // ALIGN) * ALIGN
        block_size = min(self.first << min(self.shared, 7), self.largest)
        if size > block_size:
            return self._put(_Block(size, dedicated=True), first_free=True), None
        for i in range(len(self.blocks) - 1, -1, -1):  # the newest block first
            if self.blocks[i] is not None and (chunk := self.blocks[i].place(size)) is not None:
                return i, chunk
        block = _Block(block_size)
        self.shared += 1
        i = self._put(block, first_free=False)
        return i, block.place(size)

    def _put(self, block: _Block, first_free: bool) -> int:
        """The slot a new block takes: the first free one for a dedicated block, the last free one for a shared block
        (gpu-allocator's scans), else a new slot."""
        free = [i for i, b in enumerate(self.blocks) if b is None]
        if free:
            i = free[0] if first_free else free[-1]
            self.blocks[i] = block
            return i
        self.blocks.append(block)
        return len(self.blocks) - 1

    def free(self, handle: tuple[int, tuple[int, int] | None]) -> None:
        i, chunk = handle
        block = self.blocks[i]
        if block.dedicated:
            self.blocks[i] = None
            return
        block.release(chunk)
        if block.used == 0 and self.shared > 1:
            self.blocks[i] = None
            self.shared -= 1


class Heap:
    """The pools of one device, by kind of adapter: "discrete", "integrated" or "cpu" (one pool for everything)."""

    def __init__(self, kind: str = "discrete"):
        self.kind = kind
        host = Pool(*HOST_BLOCKS)
        self.pools = dict.fromkeys(POOLS, host) if kind == "cpu" else {
            "device": Pool(*DEVICE_BLOCKS), "upload": Pool(*HOST_BLOCKS), "readback": Pool(*HOST_BLOCKS)}

    def alloc(self, pool: str, size: int):
        return pool, self.pools[pool].alloc(size)

    def free(self, handle) -> None:
        pool, h = handle
        self.pools[pool].free(h)

    @property
    def gpu_bytes(self) -> int:
        """Bytes held in GPU memory (on a discrete GPU: not the read-back pool, which is system RAM)."""
        return sum(p.held for p in {id(self.pools[n]): self.pools[n] for n in COUNTED[self.kind]}.values())


@dataclass(frozen=True)
class Footprint:
    open: int  # GPU bytes the opened device holds before the load
    steady: int  # after the load, its staging copies freed
    peak: int  # the most at any point of the load


def load_footprint(reserved: list, uploads: list, built: list, kind: str = "discrete") -> Footprint:
    """GPU memory of a load that creates `reserved` (BufferNeeds, in order) up front, uploads `uploads` (BufferNeeds
    whose bytes go through staging copies, in order: engine/gpu.py flushes them one window at a time), then creates
    `built` (buffers the blocks make themselves while building), and finally syncs."""
    heap = Heap(kind)
    for size in OPEN_BUFFERS:
        heap.alloc("device", size)
    opened = heap.gpu_bytes
    for n in reserved:
        heap.alloc(pool_of(n.how), n.bytes)
    peak, staged, pending = heap.gpu_bytes, [], 0
    for n in uploads:
        if flushes_before(pending, n.bytes):
            for h in staged:
                heap.free(h)
            staged, pending = [], 0
        pending += n.bytes
        staged.append(heap.alloc("upload", n.bytes))
        peak = max(peak, heap.gpu_bytes)
    for n in built:
        heap.alloc(pool_of(n.how), n.bytes)
        peak = max(peak, heap.gpu_bytes)
    for h in staged:
        heap.free(h)
    return Footprint(opened, heap.gpu_bytes, peak)
