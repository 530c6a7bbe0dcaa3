"""Routed experts streamed from host memory through a GPU expert cache (a MoE model over its weights budget).

Each MoE layer keeps its routed experts' packed bytes on the host (numpy arrays, memory-mapped from the checkpoint
where the reader can: engine/formats/mlx.py) and `slots` of them on the GPU, in slot-stacked buffers laid out
exactly as the resident stacks are (slot j's rows where expert j's would be), plus the shared expert, when it is
stacked, in the last slot. The expert kernels read the slot of each (token, routing slot) from `slot_ids`, which the
host writes, instead of the router's expert ids: the arithmetic is the resident model's, only addresses change.

Per forward and MoE layer: the router's top-k ids are copied to a mapped buffer and read back (each layer's routing
depends on the layer before, so one wait per layer), the policy (SlotMap: LRU or LFU) assigns slots, the missing
experts' bytes are gathered into one mapped staging buffer per upload round and copied to their slots on the GPU
(consecutive slots in one copy). A prefill chunk whose experts outnumber the slots runs in batches of experts that
fit: each batch's down pass writes a second buffer whose rows of that batch are then selected into y, so every
(token, slot) row is computed once, by the same kernel as without a budget.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict

import numpy as np
import wgpu

from engine.blocks import BufferNeed

STAGING_EXPERTS = 32  # experts per upload round (the staging buffer holds this many, or the cache if smaller)
STAGING = wgpu.BufferUsage.MAP_WRITE | wgpu.BufferUsage.COPY_SRC
# Host seconds of a streamed forward by phase (ExpertStream.seconds; bench/expert_stream.py --breakdown prints them).
PHASES = ("record", "submit", "ids_wait", "ids_read", "policy", "staging_wait", "gather", "copy_submit",
          "slot_write")


class SlotMap:
    """Which expert sits in which of `slots` GPU slots for one layer, and what to evict on a miss.

    lru: the least recently used expert goes; lfu: the least used (ties: the least recent), its counts halved every
    HALF_LIFE requests so a new topic's experts can displace an old one's. Experts asked for together are never
    evicted by each other. Counts hits and misses. bench/expert_policy.py measures both."""

    HALF_LIFE = 256  # requests (decode tokens) between two halvings of the LFU counts

    def __init__(self, experts: int, slots: int, policy: str = "lru"):
        if policy not in ("lru", "lfu"):
            raise ValueError(f"eviction policy must be 'lru' or 'lfu', got {policy!r}")
        self.experts, self.slots, self.policy = experts, slots, policy
        self.where: OrderedDict[int, int] = OrderedDict()  # expert -> slot, least recent first
        self.uses = np.zeros(experts, np.int64)
        self.free = list(range(slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.hits = self.misses = 0
        self._requests = 0

    def assign(self, wanted) -> tuple[dict[int, int], list[tuple[int, int]]]:
        """Slots for the distinct experts `wanted` (at most `slots` of them): (expert -> slot, [(expert, slot) to
        upload]). Hits and misses count each expert once per call."""
        wanted = list(dict.fromkeys(int(e) for e in wanted))
        if len(wanted) > self.slots:
            raise ValueError(f"{len(wanted)} experts asked for at once; the cache has {self.slots} slots")
        keep = set(wanted)
        out, loads = {}, []
        self._requests += 1
        if self._requests % self.HALF_LIFE == 0:
            self.uses //= 2
        for e in wanted:
            self.uses[e] += 1
            if e in self.where:
                self.where.move_to_end(e)
                out[e] = self.where[e]
                self.hits += 1
        for e in wanted:
            if e in out:
                continue
            slot = self.free.pop() if self.free else self._evict(keep)
            self.where[e] = out[e] = slot
            loads.append((e, slot))
            self.misses += 1
        return out, loads

    def _evict(self, keep: set) -> int:
        if self.policy == "lru":
            victim = next(e for e in self.where if e not in keep)
        else:  # the first (least recent) of the least used
            victim = min((e for e in self.where if e not in keep), key=lambda e: self.uses[e])
        return self.where.pop(victim)

    def batches(self, experts) -> list[list[int]]:
        """The distinct experts of a chunk in batches of at most `slots`, the resident ones first (so the first
        batch evicts nothing it will need)."""
        distinct = list(dict.fromkeys(int(e) for e in experts))
        distinct.sort(key=lambda e: e not in self.where)
        return [distinct[i:i + self.slots] for i in range(0, len(distinct), self.slots)]


def part_rows(arr) -> tuple[int, int]:
    """(experts, bytes per expert) of a host stack [E, ...]."""
    return arr.shape[0], int(arr.nbytes) // arr.shape[0]


class ExpertStream:
    """The host stacks, slot maps, staging and counters of every streamed MoE layer (the cache buffers are the MoE
    block's). An expert's parts are keyed (stack, "w" | "s"): its codes (or f16 weights) and scales of gate_up and
    down, `n_slots` is the routing slots per token (top_k + the shared expert)."""

    def __init__(self, experts: int, slots: int, top_k: int, n_slots: int, max_tokens: int, layers, policy: str,
                 expert_part_bytes: dict[tuple[str, str], int]):
        self.E, self.slots, self.top_k, self.n_slots, self.T = experts, slots, top_k, n_slots, max_tokens
        self.layers, self.policy = tuple(layers), policy
        self.part_bytes = expert_part_bytes  # (stack, key) -> bytes of one expert in the GPU layout
        self.staging_experts = max(1, min(STAGING_EXPERTS, slots))
        self.maps = {i: SlotMap(experts, slots, policy) for i in self.layers}
        self.host: dict[int, dict[tuple[str, str], np.ndarray]] = {}
        self.uploaded_bytes = 0
        self.upload_seconds = 0.0
        self.seconds = dict.fromkeys(PHASES, 0.0)
        # A benchmark's stand-in for the router's choice: route(layer, T) -> expert ids [T, top_k] used in place of
        # the ones read back (bench/expert_stream.py: random and skewed routing). None in normal use.
        self.route = None

    # ---- plan ------------------------------------------------------------------------------------------------
    def expert_bytes(self) -> int:
        return sum(self.part_bytes.values())

    def needs(self) -> list[BufferNeed]:
        T, S = self.T, self.n_slots
        return [BufferNeed.buffer("moe.slot_ids", 4 * T * S),
                BufferNeed.buffer("moe.ids_readback", 4 * T * S, usage="readback"),
                BufferNeed.buffer("moe.rows_mask", 4 * T * S),
                BufferNeed.buffer("moe.expert_staging", 2 * self.staging_bytes())]  # two, mapped in turn

    def staging_bytes(self) -> int:
        return self.staging_experts * self.expert_bytes()

    # ---- counters --------------------------------------------------------------------------------------------
    @property
    def hits(self) -> int:
        return sum(m.hits for m in self.maps.values())

    @property
    def misses(self) -> int:
        return sum(m.misses for m in self.maps.values())

    def reset_counters(self) -> None:
        for m in self.maps.values():
            m.hits = m.misses = 0
        self.uploaded_bytes, self.upload_seconds = 0, 0.0
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def hit_rate(self) -> float | None:
        n = self.hits + self.misses
        return self.hits / n if n else None

    def resident_share(self) -> float:
        return min(1.0, self.slots / self.E)

    # ---- load ------------------------------------------------------------------------------------------------
    def keep_host(self, layer: int, stack: str, key: str, arr) -> None:
        """A routed stack's array kept on the host ([E, ...]; a memmap stays a memmap)."""
        E, per = part_rows(arr)
        if E != self.E or per != self.part_bytes[stack, key]:
            raise ValueError(f"layer {layer} {stack}.{key}: host stack of {E} experts × {per} bytes, expected "
                             f"{self.E} × {self.part_bytes[stack, key]}")
        self.host.setdefault(layer, {})[stack, key] = arr

    def build(self, gpu, readback) -> None:
        self.gpu, self.readback = gpu, readback
        size = max(16, (self.staging_bytes() + 3) // 4 * 4)
        self.staging = [gpu.device.create_buffer(label=f"moe.expert_staging.{j}", size=size, usage=STAGING)
                        for j in range(2)]
        self._turn = 0

    # ---- per forward -----------------------------------------------------------------------------------------
    def read_ids(self, T: int) -> np.ndarray:
        """The router's ids [T, n_slots] copied into the readback buffer by the forward just submitted."""
        buf, t0 = self.readback, time.perf_counter()
        buf.map_sync(mode=wgpu.MapMode.READ)
        t1 = time.perf_counter()
        try:
            return np.frombuffer(buf.read_mapped(0, T * self.n_slots * 4), np.uint32).reshape(T, self.n_slots).copy()
        finally:
            buf.unmap()
            self.seconds["ids_wait"] += t1 - t0
            self.seconds["ids_read"] += time.perf_counter() - t1

    def upload(self, layer: int, cache: dict[tuple[str, str], object], loads: list[tuple[int, int]]) -> None:
        """Copy the experts `loads` ([(expert, slot)]) from the host stacks into their cache slots: per round one
        mapped staging buffer holds every part of up to staging_experts experts, then GPU copies move each run of
        consecutive slots at once."""
        started = time.perf_counter()
        sec = self.seconds
        host, parts = self.host[layer], list(self.part_bytes)
        loads = sorted(loads, key=lambda es: es[1])
        for r0 in range(0, len(loads), self.staging_experts):
            batch = loads[r0:r0 + self.staging_experts]
            ids = np.fromiter((e for e, _ in batch), np.int64, len(batch))
            staging = self.staging[self._turn]
            self._turn ^= 1
            t0 = time.perf_counter()
            staging.map_sync(mode=wgpu.MapMode.WRITE)  # waits for the copies that last read this buffer
            t1 = time.perf_counter()
            sec["staging_wait"] += t1 - t0
            offsets, offset = {}, 0
            for part in parts:
                offsets[part], offset = offset, offset + len(batch) * self.part_bytes[part]
            mapped = _mapped_bytes(staging, offset)
            try:
                if mapped is not None:  # straight into the mapped staging: one host copy, on several threads
                    _gather_all([(host[part], ids, mapped[offsets[part]:offsets[part] + len(batch) *
                                                          self.part_bytes[part]]) for part in parts])
                else:
                    for part in parts:
                        staging.write_mapped(_gather(host[part], ids), offsets[part])
            finally:
                del mapped  # no view of the mapping may outlive it
                staging.unmap()
            t2 = time.perf_counter()
            sec["gather"] += t2 - t1
            enc = self.gpu.device.create_command_encoder(label="expert-upload")
            for part in parts:
                size = self.part_bytes[part]
                for j, first, count in _runs([slot for _, slot in batch]):
                    enc.copy_buffer_to_buffer(staging, offsets[part] + j * size, cache[part], first * size,
                                              count * size)
            self.gpu.queue.submit([enc.finish()])
            sec["copy_submit"] += time.perf_counter() - t2
            self.uploaded_bytes += offset
        self.upload_seconds += time.perf_counter() - started


def _gather(arr, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The experts `ids` of a host stack as contiguous bytes, written into `out` (u8) when given (a memmap reads
    only those experts' pages; a lazy row join takes each part's rows into its share of every expert)."""
    n = len(ids)
    if out is None:
        out = np.empty(n * (int(arr.nbytes) // arr.shape[0]), np.uint8)
    parts = getattr(arr, "parts", None)
    if parts is not None:  # engine/formats/mlx_layout.py RowJoin: [E, N_i, W] parts joined along N
        rows = out.view(arr.dtype).reshape(n, arr.shape[1], -1)
        r = 0
        for p in parts:
            np.take(p, ids, axis=0, out=rows[:, r:r + p.shape[1]], mode="clip")
            r += p.shape[1]
    else:
        np.take(arr.reshape(arr.shape[0], -1), ids, axis=0, out=out.view(arr.dtype).reshape(n, -1), mode="clip")
    return out


_POOL = None
GATHER_THREADS = min(8, os.cpu_count() or 1)  # numpy's take releases the GIL: host copies scale with cores
MIN_THREAD_BYTES = 1 << 20  # below this a copy runs on the caller's thread


def _gather_all(jobs: list[tuple]) -> None:
    """Each (host stack, ids, out) gathered into `out`, split by experts over a thread pool."""
    global _POOL
    tasks = []
    for arr, ids, out in jobs:
        per = len(out) // len(ids)
        step = max(1, -(-len(ids) // GATHER_THREADS), MIN_THREAD_BYTES // max(per, 1))
        tasks += [(arr, ids[j:j + step], out[j * per:(j + len(ids[j:j + step])) * per])
                  for j in range(0, len(ids), step)]
    if len(tasks) == 1 or GATHER_THREADS == 1:
        for t in tasks:
            _gather(*t)
        return
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(GATHER_THREADS, thread_name_prefix="expert-gather")
    for f in [_POOL.submit(_gather, *t) for t in tasks]:
        f.result()


def _mapped_bytes(buf, size: int) -> np.ndarray | None:
    """A writable u8 view of a buffer mapped for writing (wgpu-py's experimental accessor), else None."""
    get = getattr(buf, "_experimental_get_mapped_range", None)
    if get is None:
        return None
    try:
        view = np.frombuffer(get(0, (size + 3) // 4 * 4), np.uint8)
    except (TypeError, ValueError, RuntimeError):
        return None
    return view if view.flags.writeable else None


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """Sorted slots as (position in the list, first slot, count) runs of consecutive slots."""
    out: list[list[int]] = []
    for j, s in enumerate(slots):
        if out and out[-1][1] + out[-1][2] == s:
            out[-1][2] += 1
        else:
            out.append([j, s, 1])
    return [(j, a, b) for j, a, b in out]
