"""The runtime's blocks: each owns its pipelines, buffers, bind groups and recording for every layer that uses it.

A block is first *planned* from the model spec, the weight formats, the RuntimeOptions and the GPU's traits
(DeviceTraits): it then knows the checkpoint tensors it takes (`tensors`) and every GPU buffer it will allocate
(`needs`), with no GPU at hand — memfit sums these. With a GPU it takes its tensors as the checkpoint streams by
(`take`), allocates and binds (`build`), and records its dispatches for T rows (`record`). Blocks:
residual (the norms between blocks), attention and gated_deltanet (mixers), mlp and moe (feed-forward), vocab
(embedding and LM head) and sampler. engine/transformer.py walks the layers through them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from engine.errors import GpuError
from engine.gpu import USAGE_OF, PlanRecorder

KINDS = ("weights", "kv", "state", "scratch")


def buffer_bytes(size: int) -> int:
    """What Gpu.buffer allocates for `size` bytes (whole words, never a zero-size binding)."""
    return max(16, (int(size) + 3) // 4 * 4)


def upload_bytes(nbytes: int) -> int:
    """What Gpu.upload allocates for an array of `nbytes` bytes (padded to whole words)."""
    return max(4, (int(nbytes) + 3) // 4 * 4)


def array_bytes(shape: tuple, dtype: str) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


@dataclass(frozen=True)
class BufferNeed:
    """One GPU buffer a block allocates: its label, bytes as allocated, what it holds, and how it is made."""

    label: str
    bytes: int
    kind: str  # "weights" | "kv" | "state" | "scratch"
    # "buffer" (Gpu.buffer), "uniform", "readback", "upload" (Gpu.upload of that many bytes), or "staging" (a
    # buffer the host writes, made by its block itself: the expert stream's)
    how: str = "buffer"
    # an "upload" filled by several staged writes (two layers' expert stacks in one buffer: engine/blocks/moe.py), their
    # bytes in order; empty: one upload of the whole buffer
    writes: tuple[int, ...] = ()

    @classmethod
    def buffer(cls, label: str, size: int, kind: str = "scratch", usage: str = "buffer") -> BufferNeed:
        return cls(label, buffer_bytes(size), kind, usage)

    @classmethod
    def upload(cls, label: str, nbytes: int, kind: str = "weights") -> BufferNeed:
        return cls(label, upload_bytes(nbytes), kind, "upload")

    def allocate(self, gpu):
        """The buffer, made as planned (uploads are made by their owner with their data)."""
        return gpu.buffer(self.label, self.bytes, USAGE_OF[self.how])


@dataclass(frozen=True)
class DeviceTraits:
    """What a plan needs to know of the GPU. memfit plans for a typical discrete GPU (`typical()`)."""

    max_binding: int | None  # max-storage-buffer-binding-size; None: unknown (plans assume everything fits one)
    offset_alignment: int  # min-storage-buffer-offset-alignment
    subgroups: bool  # the device runs subgroup ops (int8 matvecs, subgroup-rows matvecs)
    subgroup_size: int
    memory_bytes: int | None = None  # the adapter's memory where the system tells it (the weights budget's auto)
    max_threads: int = 256  # max-compute-invocations-per-workgroup (WebGPU's default where unknown)
    memory_kind: str = "discrete"  # how its allocator pools memory (engine/gpu_heap.py): discrete, integrated or cpu
    max_buffer: int | None = None  # max-buffer-size; None: unknown (plans assume it holds any buffer they make)
    storage_buffers: int = 8  # max-storage-buffers-per-shader-stage (WebGPU's default where unknown)

    @classmethod
    def of(cls, gpu) -> DeviceTraits:
        from engine.vram import adapter_memory

        info = getattr(gpu, "info", None)
        kind = {"CPU": "cpu", "IntegratedGPU": "integrated"}.get(getattr(info, "adapter_type", ""), "discrete")
        limits = gpu.limits
        return cls(gpu.max_binding, limits.get("min-storage-buffer-offset-alignment", 256), gpu.use_subgroups,
                   gpu.subgroup_size, adapter_memory(info), limits.get("max-compute-invocations-per-workgroup", 256),
                   kind, limits.get("max-buffer-size"), limits.get("max-storage-buffers-per-shader-stage", 8))

    @classmethod
    def typical(cls, max_binding: int | None = None) -> DeviceTraits:
        return cls(max_binding, 256, True, 32, max_threads=1024, storage_buffers=32)  # Vulkan/D3D12/Metal GPUs: ≥ 31


def upload_weight(gpu, label: str, arr: np.ndarray, parts_ok: bool = False, source: str = ""):
    """Upload one weight tensor into its planned buffer (`label`: the BufferNeed's). Only the vocabulary matrices are
    bound in parts, so any other tensor must fit one binding: caught here, with the numbers (and the checkpoint's
    name, `source`), rather than as a validation error when it is bound."""
    if arr.nbytes > gpu.max_binding and not parts_ok:
        raise GpuError(f"tensor {source or label} is {arr.nbytes:,} bytes, but this GPU binds at most "
                       f"{gpu.max_binding:,} (max-storage-buffer-binding-size)")
    return gpu.upload(label, arr)


class Block:
    """Base of the runtime's blocks. Subclasses set `name` and `layers` and implement the plan / load / build /
    record steps; rollback-aware blocks override the state hooks."""

    name = "block"
    layers: tuple[int, ...] = ()
    # A block whose state cannot be truncated like a KV cache asks for a snapshot before a prompt's last token.
    keeps_state = False

    # ---- plan (no GPU) ------------------------------------------------------------------------------------
    def tensors(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Canonical checkpoint tensor -> (shape, dtype) this block takes."""
        return {}

    def needs(self) -> list[BufferNeed]:
        """Every GPU buffer this block allocates (weights included), as it will allocate them."""
        return []

    def shared_needs(self) -> dict[str, int]:
        """Scratch buffers shared with other blocks (name -> bytes this block needs of it); the workspace
        allocates each once, at the largest size asked."""
        return {}

    def can_carry_norms(self) -> bool:
        """Whether the block's decode matvecs can carry the residual add + norm around it (engine/blocks/residual.py):
        those reading the normed row take matvec_q8_rms, the one ending the block matvec_q8_norm. Set
        then: `norms`, the residual block."""
        return False

    # the matrix (in `lin[layer]`) whose decode matvec ends the block in the residual add + next norm (matvec_q8_norm)
    norm_producer: str | None = None

    def norm_matvec_splits(self) -> int:
        """The most workgroups a 32-output chunk of this block's matvec_q8_norm dispatches take (the workspace's packed
        row keeps room for that many partials)."""
        if self.norm_producer is None:
            return 1
        return max(self.lin[i][self.norm_producer].norm_splits for i in self.layers)

    def int8_row_k(self) -> int:
        """The widest input row (elements) this block's int8 decode matvecs read from the workspace's int8 row."""
        return 0

    def int8_formats(self) -> set[str]:
        """The weight formats of this block's products that take int8 activations (decode or prefill), from its
        `lin` matrices where it has them: the runtime writes int8 rows in element order only where all of a model's
        are K-quant blocks (engine/transformer.py RuntimePlan.q8_natural)."""
        return {part.tag for mats in getattr(self, "lin", {}).values() for lin in mats.values()
                for part in getattr(lin, "parts", [lin]) if part.int8 or part.int8_prefill}

    # ---- load and build (GPU) -----------------------------------------------------------------------------
    def take(self, gpu, name: str, arr: np.ndarray, source: str = "") -> None:
        """One checkpoint tensor of `tensors()` (its checkpoint name: `source`) as the checkpoint streams by:
        uploaded, or held until the tensors it is fused with arrive."""
        raise NotImplementedError

    def build(self, gpu, ws) -> None:
        """Allocate the non-weight buffers, build pipelines and bind groups (after every tensor was taken)."""

    def record(self, rec, layer: int, T: int, splits: int) -> None:
        """Dispatches for T rows of `layer` (T == 1: the decode kernels; splits: decode attention partitions)."""

    # ---- state hooks (blocks that keep state across positions) ------------------------------------------
    def reset(self) -> None:
        pass

    def before_single_token(self, rec, pos: int) -> None:
        """Before a one-token forward at position `pos` is recorded (outside any captured plan)."""

    def before_prompt_end(self, pos: int) -> None:
        """Before a prompt's last token (at `pos`) is fed."""

    def rollback(self, n: int, at: int) -> int:
        """Roll back to a cache of n tokens, the block's state being at position `at`: the position its state is
        at afterwards (≤ n: the runtime replays the rest)."""
        return n

    def release(self) -> None:
        """Destroy every GPU buffer this block holds now (a load that failed or was cancelled frees its memory at
        once, whatever still refers to the half-built runtime)."""
        destroy_buffers(vars(self))

    # ---- report ------------------------------------------------------------------------------------------
    def bytes_by_kind(self) -> dict[str, int]:
        out = dict.fromkeys(KINDS, 0)
        for need in self.needs():
            out[need.kind] += need.bytes
        return out

    def dispatches_per_token(self, splits: int = 1) -> int:
        """Dispatches of one decode token over all of this block's layers (captured, not counted by hand)."""
        cap = PlanRecorder()
        for layer in self.layers or (0,):
            self.record(cap, layer, 1, splits)
        return cap.dispatches


def destroy_buffers(value, depth: int = 0) -> None:
    """Destroy the wgpu buffers in `value` and the dicts, lists and tuples it holds (a few levels deep)."""
    import wgpu

    if isinstance(value, wgpu.GPUBuffer):
        value.destroy()
    elif depth < 4 and isinstance(value, dict):
        for v in value.values():
            destroy_buffers(v, depth + 1)
    elif depth < 4 and isinstance(value, (list, tuple)):
        for v in value:
            destroy_buffers(v, depth + 1)


def sum_needs(needs: Iterable[BufferNeed]) -> dict[str, int]:
    out = dict.fromkeys(KINDS, 0)
    for need in needs:
        out[need.kind] += need.bytes
    return out
