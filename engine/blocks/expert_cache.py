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

A decode token keeps the host off the GPU's path where it can (engine/transformer.py records it): each segment up to
a MoE layer's routing is recorded while the one before runs; the layer's slots come from a per-layer expert -> slot
table on the GPU (shaders/expert_slots.wgsl) that every upload updates, so a layer whose experts are all cached
needs no host write; the uploads go in the same submission as the segment after them; the routing's readback
alternates between two buffers (waited for as MAP_WAIT says: engine/mapping.py); staging buffers are mapped again
while the GPU runs, so an upload finds one ready.
"""

from __future__ import annotations

import heapq
import os
import time
from collections import OrderedDict

import numpy as np
import wgpu

from engine.blocks import BufferNeed, buffer_bytes
from engine.gpu import copy_buffer
from engine.mapping import buffer_map

STAGING_EXPERTS = 32  # experts per upload round (the staging buffer holds this many, or the cache if smaller)
STAGING = wgpu.BufferUsage.MAP_WRITE | wgpu.BufferUsage.COPY_SRC
# Host seconds of a streamed forward by phase (ExpertStream.seconds; bench/expert_stream.py --breakdown prints them).
PHASES = ("record", "submit", "ids_wait", "ids_read", "route", "policy", "staging_wait", "gather", "copies",
          "slot_write")
TABLE_ALIGN = 256  # bytes from one layer's slot table to the next (WebGPU's largest storage offset alignment)


class SlotMap:
    """Which expert sits in which of `slots` GPU slots for one layer, and what to evict on a miss.

    lru: the least recently used expert goes; lfu: the least used (ties: the least recent), its counts halved every
    HALF_LIFE requests so a new topic's experts can displace an old one's. Experts asked for together are never
    evicted by each other. Counts hits and misses. bench/expert_policy.py measures both. LFU finds its victim in a
    heap of (uses, last use, expert) entries, stale ones skipped (a scan of every slot per miss cost more than the
    rest of a decode layer's host work)."""

    HALF_LIFE = 256  # requests (decode tokens) between two halvings of the LFU counts

    def __init__(self, experts: int, slots: int, policy: str = "lru"):
        if policy not in ("lru", "lfu"):
            raise ValueError(f"eviction policy must be 'lru' or 'lfu', got {policy!r}")
        self.experts, self.slots, self.policy = experts, slots, policy
        self.where: OrderedDict[int, int] = OrderedDict()  # expert -> slot, least recent first
        self.uses = [0] * experts
        self._last = [0] * experts  # when each expert was last asked for (the order of `where`)
        self._clock = 0
        self._heap: list[tuple[int, int, int]] = []  # lfu: (uses, last, expert), valid while it matches both
        self.free = list(range(slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.hits = self.misses = 0
        self._requests = 0

    def assign(self, wanted) -> tuple[dict[int, int], list[tuple[int, int]]]:
        """Slots for the distinct experts `wanted` (at most `slots` of them): (expert -> slot, [(expert, slot) to
        upload]). Hits and misses count each expert once per call."""
        wanted = list(dict.fromkeys(int(e) for e in wanted))
        if len(wanted) > self.slots:
            raise ValueError(f"{len(wanted)} experts asked for at once; the cache has {self.slots} slots")
        where, uses, lfu = self.where, self.uses, self.policy == "lfu"
        out, loads, keep = {}, [], set(wanted)
        self._requests += 1
        if self._requests % self.HALF_LIFE == 0:
            self.uses = uses = [u >> 1 for u in uses]
            if lfu:
                self._heap = [(uses[e], self._last[e], e) for e in where]
                heapq.heapify(self._heap)
        for e in wanted:
            uses[e] += 1
            if e in where:
                where.move_to_end(e)
                self._touch(e)
                out[e] = where[e]
                self.hits += 1
        for e in wanted:
            if e in out:
                continue
            slot = self.free.pop() if self.free else self._evict(keep)
            where[e] = out[e] = slot
            self._touch(e)
            loads.append((e, slot))
            self.misses += 1
        return out, loads

    def _touch(self, e: int) -> None:
        self._clock += 1
        self._last[e] = self._clock
        if self.policy == "lfu":
            if len(self._heap) > 4 * self.slots + 64:  # drop the stale entries now and then
                self._heap = [(self.uses[x], self._last[x], x) for x in self.where if x != e]
                heapq.heapify(self._heap)
            heapq.heappush(self._heap, (self.uses[e], self._clock, e))

    def _evict(self, keep) -> int:
        if self.policy == "lru":
            victim = next(e for e in self.where if e not in keep)
        else:  # the least used, then the least recent
            held, heap, uses, last, where = [], self._heap, self.uses, self._last, self.where
            while True:
                entry = heapq.heappop(heap)
                u, t, victim = entry
                if victim not in where or uses[victim] != u or last[victim] != t:
                    continue  # stale: the expert was used again, evicted, or its count halved
                if victim not in keep:
                    break
                held.append(entry)
            for entry in held:
                heapq.heappush(heap, entry)
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
        self.host: dict[int, dict[tuple[str, str], np.ndarray]] = {}
        self.uploaded_bytes = 0
        self.upload_seconds = 0.0
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.table_stride = -(-experts * 4 // TABLE_ALIGN) * TABLE_ALIGN
        self.table_index = {layer: j for j, layer in enumerate(self.layers)}
        self._forget_slots()
        # A benchmark's stand-in for the router's choice: route(layer, T) -> expert ids [T, top_k] used in place of
        # the ones read back (bench/expert_stream.py: random and skewed routing). None in normal use.
        self.route = None

    # ---- plan ------------------------------------------------------------------------------------------------
    def expert_bytes(self) -> int:
        return sum(self.part_bytes.values())

    def needs(self) -> list[BufferNeed]:
        T, S = self.T, self.n_slots
        return [BufferNeed.buffer("moe.slot_ids", 4 * T * S),
                BufferNeed.buffer("moe.slot_table", len(self.layers) * self.table_stride),
                *(BufferNeed.buffer(f"moe.ids_readback.{j}", 4 * T * S, usage="readback") for j in range(2)),
                BufferNeed.buffer("moe.rows_mask", 4 * T * S),
                *(BufferNeed(f"moe.expert_staging.{j}", buffer_bytes(self.staging_size()), "scratch", "staging")
                  for j in range(2))]  # two, mapped in turn (build makes them, mapped)

    def staging_bytes(self) -> int:
        return self.staging_experts * self.expert_bytes()

    def staging_size(self) -> int:
        """One staging buffer: a round of experts, then a layer's slot table."""
        return self.staging_bytes() + 4 * self.E

    def table_range(self, layer: int) -> tuple[int, int]:
        """(offset, bytes) of `layer`'s expert -> slot table in the slot table buffer."""
        return self.table_index[layer] * self.table_stride, 4 * self.E

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

    def build(self, gpu, readbacks: list, table) -> None:
        self.gpu, self.readbacks, self.table = gpu, list(readbacks), table
        size = buffer_bytes(self.staging_size())
        self.staging = [gpu.device.create_buffer(label=f"moe.expert_staging.{j}", size=size, usage=STAGING,
                                                 mapped_at_creation=True) for j in range(2)]
        self.staging_maps = [buffer_map(gpu, b, MAP_WAIT) for b in self.staging]
        self.readback_maps = {id(b): buffer_map(gpu, b, MAP_WAIT) for b in self.readbacks}
        for m in self.staging_maps:
            m.mapped_now()
        self._staged: list = ["mapped", "mapped"]  # per staging buffer: "mapped", "pending" (asked for) or "used"
        self._unsent: set[int] = set()  # staging buffers read by command buffers still in `pending`
        self.pending: list = []  # upload command buffers not yet handed to a recorder
        self._turn = 0
        self._requested: list = []  # readback buffers a recorded copy of the routing targets, oldest first
        self._reading = None  # (readback mapping, tokens) of the routing submitted last
        self._rb_turn = 0
        self._write_tables()

    # ---- the slot tables ---------------------------------------------------------------------------------------
    def _forget_slots(self) -> None:
        """Every layer's cache empty: new slot maps (counters kept) and tables of unused slots."""
        old = getattr(self, "maps", {})
        self.maps = {i: SlotMap(self.E, self.slots, self.policy) for i in self.layers}
        for i, m in old.items():
            self.maps[i].hits, self.maps[i].misses = m.hits, m.misses
        # The host's copy of each GPU table: expert -> its slot, `slots` (the shared expert's, unread) when absent.
        self.slot_of = {i: np.full(self.E, self.slots, np.uint32) for i in self.layers}
        self._occupant = {i: [-1] * self.slots for i in self.layers}

    def _write_tables(self) -> None:
        rows = np.full((len(self.layers), self.table_stride // 4), self.slots, np.uint32)
        for i, j in self.table_index.items():
            rows[j, :self.E] = self.slot_of[i]
        self.gpu.write(self.table, rows)

    def forget(self) -> None:
        """Empty the cache after a forward that stopped half-way (uploads it planned may never have been submitted):
        later tokens load what they need again."""
        self.pending.clear()
        self._unsent.clear()
        self._requested.clear()
        if self._reading is not None:
            m, _ = self._reading
            self._reading = None
            m.wait()
            m.unmap()
        self._forget_slots()
        self._write_tables()

    def _note_loads(self, layer: int, loads: list[tuple[int, int]]) -> None:
        table, occupant = self.slot_of[layer], self._occupant[layer]
        for e, slot in loads:
            if occupant[slot] >= 0:
                table[occupant[slot]] = self.slots
            table[e], occupant[slot] = slot, e

    # ---- the routing's readback --------------------------------------------------------------------------------
    def request_ids(self, rec, ids, T: int) -> None:
        """Record the copy of the router's ids [T, n_slots] into the next readback buffer (read after a submit)."""
        buf = self.readbacks[self._rb_turn]
        self._rb_turn ^= 1
        rec.copy(ids, 0, buf, 0, 4 * T * self.n_slots)
        self._requested.append((buf, T))

    def map_ids(self) -> None:
        """Right after the submit holding the oldest requested copy: map its buffer, and the staging buffers whose
        copies went in that submit or before, all to land when the GPU gets there."""
        buf, T = self._requested.pop(0)
        m = self.readback_maps[id(buf)]
        m.map("READ_NOSYNC", 0, 4 * T * self.n_slots)
        self._reading = (m, T)
        for j, state in enumerate(self._staged):
            if state == "used" and j not in self._unsent:
                self.staging_maps[j].map(wgpu.MapMode.WRITE, 0, self.staging[j].size)
                self._staged[j] = "pending"

    def wait_ids(self) -> np.ndarray:
        """The routing [T, n_slots] mapped last (map_ids), once the GPU has written it."""
        m, T = self._reading
        t0 = time.perf_counter()
        m.wait()
        t1 = time.perf_counter()
        self._reading = None  # mapped now (an interrupted wait leaves it for forget)
        try:
            return m.view(0, 4 * T * self.n_slots, False).view(np.uint32).reshape(T, self.n_slots).copy()
        finally:
            m.unmap()
            self.seconds["ids_wait"] += t1 - t0
            self.seconds["ids_read"] += time.perf_counter() - t1

    # ---- uploads -----------------------------------------------------------------------------------------------
    def _ready_staging(self, j: int):
        """Staging buffer j mapped for writing (its earlier copies done)."""
        state, m = self._staged[j], self.staging_maps[j]
        if state == "used":
            if j in self._unsent:  # its copies are not submitted yet: they go now, ahead of anything else
                self.gpu.queue.submit(self.take_pending())
            m.map(wgpu.MapMode.WRITE, 0, self.staging[j].size)
        if state != "mapped":
            m.wait()
            self._staged[j] = "mapped"
        return m

    def upload(self, layer: int, cache: dict[tuple[str, str], object], loads: list[tuple[int, int]]) -> None:
        """Copy the experts `loads` ([(expert, slot)]) from the host stacks into their cache slots, and the layer's
        slot table after them: per round one mapped staging buffer holds every part of up to staging_experts
        experts, then GPU copies move each run of consecutive slots at once. The copies' command buffers wait in
        `pending` for the caller's submit (take_pending)."""
        started = time.perf_counter()
        sec = self.seconds
        host, parts = self.host[layer], list(self.part_bytes)
        loads = sorted(loads, key=lambda es: es[1])
        self._note_loads(layer, loads)
        rounds = range(0, len(loads), self.staging_experts)
        for r0 in rounds:
            batch = loads[r0:r0 + self.staging_experts]
            last = r0 == rounds[-1]
            ids = np.fromiter((e for e, _ in batch), np.int64, len(batch))
            j = self._turn
            self._turn ^= 1
            t0 = time.perf_counter()
            staging_map = self._ready_staging(j)
            staging = self.staging[j]
            t1 = time.perf_counter()
            sec["staging_wait"] += t1 - t0
            offsets, offset = {}, 0
            for part in parts:
                offsets[part], offset = offset, offset + len(batch) * self.part_bytes[part]
            table_at, end = offset, offset + 4 * self.E * last
            mapped = staging_map.view(0, (end + 3) // 4 * 4, True)
            try:
                if mapped is not None:  # straight into the mapped staging: one host copy, on several threads
                    _gather_all([(host[part], ids, mapped[offsets[part]:offsets[part] + len(batch) *
                                                          self.part_bytes[part]]) for part in parts])
                    if last:
                        mapped[table_at:end] = self.slot_of[layer].view(np.uint8)
                else:
                    for part in parts:
                        staging_map.write(_gather(host[part], ids), offsets[part])
                    if last:
                        staging_map.write(self.slot_of[layer], table_at)
            finally:
                del mapped  # no view of the mapping may outlive it
                staging_map.unmap()
            t2 = time.perf_counter()
            sec["gather"] += t2 - t1
            enc = self.gpu.device.create_command_encoder(label="expert-upload")
            for part in parts:
                size = self.part_bytes[part]
                for k, first, count in _runs([slot for _, slot in batch]):
                    copy_buffer(enc, staging, offsets[part] + k * size, cache[part], first * size, count * size)
            if last:
                table_offset, table_bytes = self.table_range(layer)
                copy_buffer(enc, staging, table_at, self.table, table_offset, table_bytes)
            self.pending.append(enc.finish())
            self._staged[j] = "used"
            self._unsent.add(j)
            sec["copies"] += time.perf_counter() - t2
            self.uploaded_bytes += offset
        self.upload_seconds += time.perf_counter() - started

    def take_pending(self) -> list:
        """The upload command buffers recorded since the last call, for the submit that must run them first (a
        recorder's submit_first, or a submit of their own)."""
        out, self.pending = self.pending, []
        self._unsent.clear()
        return out


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
# numpy's copies release the GIL, but reading experts from DRAM saturates at a few threads (bench/host_copy_probe.py)
GATHER_THREADS = min(4, os.cpu_count() or 1)
# How the routing readbacks and staging buffers are waited for (engine/mapping.py): "polled" (non-blocking device
# polls on the calling thread) or "thread" (wgpu-py's poll thread: slower, BENCH.md); bench/expert_stream.py --wait.
MAP_WAIT = "polled"
MIN_THREAD_BYTES = 1 << 20  # below this a share runs on the caller's thread alone


def _expert_bytes(arr, e: int) -> list[np.ndarray]:
    """Expert e of a host stack as contiguous u8 runs, in the order of its GPU layout (a lazy row join: each part's
    rows in turn)."""
    return [np.asarray(p[e]).reshape(-1).view(np.uint8) for p in getattr(arr, "parts", None) or [arr]]


def _gather_all(jobs: list[tuple]) -> None:
    """Each (host stack, ids, out) gathered into `out`: the copies cut into one equal share of bytes per thread, the
    caller's thread taking the last share (per-expert tasks left threads idle while one copied two experts)."""
    global _POOL
    pieces, total = [], 0  # (source run, destination slice)
    for arr, ids, out in jobs:
        at = 0
        for e in ids:
            for run in _expert_bytes(arr, int(e)):
                pieces.append((run, out[at:at + run.size]))
                at += run.size
        total += at
    threads = max(1, min(GATHER_THREADS, total // MIN_THREAD_BYTES))
    share = -(-total // threads)
    shares, current, room = [], [], share
    for src, dst in pieces:
        while src.size:
            n = min(room, src.size)
            current.append((src[:n], dst[:n]))
            src, dst, room = src[n:], dst[n:], room - n
            if room == 0:
                shares.append(current)
                current, room = [], share
    if current:
        shares.append(current)
    if len(shares) > 1 and _POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(GATHER_THREADS, thread_name_prefix="expert-gather")
    futures = [_POOL.submit(_copy_all, job) for job in shares[:-1]]
    _copy_all(shares[-1] if shares else [])
    for f in futures:
        f.result()


def _copy_all(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for src, dst in pairs:
        np.copyto(dst, src)


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """Sorted slots as (position in the list, first slot, count) runs of consecutive slots."""
    out: list[list[int]] = []
    for j, s in enumerate(slots):
        if out and out[-1][1] + out[-1][2] == s:
            out[-1][2] += 1
        else:
            out.append([j, s, 1])
    return [(j, a, b) for j, a, b in out]
