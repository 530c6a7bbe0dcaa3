"""The GPU layer: adapter choice, device with the adapter's own limits, buffers, pipelines, sync.

Everything that talks to wgpu directly lives here; models and kernels' host side use `Gpu`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import numpy as np
import wgpu

from engine.errors import GpuError
from engine.kernels import Kernel, kernel
from engine.shaders import MODEL_CONSTANTS, build_source, with_model_constants

STORAGE = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST | wgpu.BufferUsage.COPY_SRC
UNIFORM = wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST
READBACK = wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST

# Backends we trust for compute; OpenGL lacks shader-f16 and subgroups.
GOOD_BACKENDS = ("Vulkan", "Metal", "D3D12")
_TYPE_RANK = {"DiscreteGPU": 0, "IntegratedGPU": 1, "VirtualGPU": 2, "CPU": 3}
# Drivers that run "GPU" work on the processor. Some report adapter_type CPU; some (WARP, older SwiftShader) do not,
# so the device and driver names are checked too.
_SOFTWARE_NAMES = re.compile(r"lavapipe|llvmpipe|swiftshader|\bwarp\b|microsoft basic render", re.IGNORECASE)
# Uploads stage their bytes in driver memory until the next queue submission; past this many pending bytes the
# next upload first waits for them to land, so loading holds at most one window of staging copies.
UPLOAD_WINDOW = 256 * 2**20
USAGE_OF = {"buffer": STORAGE, "upload": STORAGE, "uniform": UNIFORM, "readback": READBACK}  # by BufferNeed.how
PROBE_BYTES = 16  # the buffer of each of a device's probes (subgroup size, sync)


def flushes_before(pending: int, nbytes: int) -> bool:
    """Whether an upload of `nbytes` first waits for the `pending` bytes staged before it (one window at a time)."""
    return bool(pending) and pending + nbytes > UPLOAD_WINDOW

try:  # wgpu-native's functions unwrapped: wgpu-py's checked wrappers capture and release an error slot around every
    # call (3 calls a dispatch: the largest host cost of a token, BENCH.md). Encoding errors are still kept in the
    # pass by wgpu and raised at its end() or at submit, which go through the checked wrappers.
    from wgpu.backends.wgpu_native._api import ffi as _ffi
    from wgpu.backends.wgpu_native._api import lib as _lib

    _RAW_PASS_CALLS = (_lib.wgpuComputePassEncoderSetPipeline, _lib.wgpuComputePassEncoderSetBindGroup,
                       _lib.wgpuComputePassEncoderDispatchWorkgroups, _ffi.NULL)
    _RAW_COPY = _lib.wgpuCommandEncoderCopyBufferToBuffer
except (ImportError, AttributeError):  # another wgpu-py layout: the public API it is
    _RAW_PASS_CALLS = _RAW_COPY = None


def copy_buffer(encoder, src, src_offset: int, dst, dst_offset: int, size: int) -> None:
    """encoder.copy_buffer_to_buffer without wgpu-py's per-call error capture (a streamed layer records dozens of
    expert copies); a bad copy is still reported, by the encoder's finish()."""
    if _RAW_COPY is None:
        encoder.copy_buffer_to_buffer(src, src_offset, dst, dst_offset, size)
    else:
        _RAW_COPY(encoder._internal, src._internal, src_offset, dst._internal, dst_offset, size)


@dataclass
class AdapterInfo:
    index: int
    name: str
    backend: str
    adapter_type: str
    driver: str
    features: list[str]
    limits: dict[str, int]
    adapter: object = field(repr=False, default=None)

    def summary(self) -> str:
        return f"[{self.index}] {self.name} ({self.backend}, {self.adapter_type}, {self.driver})"

    @property
    def software(self) -> bool:
        """A software adapter: the processor does the GPU's work (slow; see engine/speed.py)."""
        return is_software_adapter(self)

    @property
    def key(self) -> str:
        """Names this adapter across runs (indices can change when drivers are added)."""
        return f"{self.backend}|{self.name}|{self.driver}"


def is_software_adapter(info) -> bool:
    """True for a CPU/software adapter (lavapipe, llvmpipe, SwiftShader, WARP, Microsoft Basic Render Driver).
    `info`: an AdapterInfo, or wgpu's adapter info dict (adapter_type, device, vendor, description)."""
    if isinstance(info, AdapterInfo):
        kind, names = info.adapter_type, (info.name, info.driver)
    else:
        get = info.get
        kind, names = get("adapter_type", ""), (get("device", ""), get("vendor", ""), get("description", ""))
    return kind == "CPU" or any(_SOFTWARE_NAMES.search(str(n or "")) for n in names)


def list_adapters() -> list[AdapterInfo]:
    out = []
    for i, a in enumerate(wgpu.gpu.enumerate_adapters_sync()):
        info = a.info
        out.append(
            AdapterInfo(
                index=i,
                name=info.get("device", "") or info.get("vendor", "unknown"),
                backend=info.get("backend_type", "?"),
                adapter_type=info.get("adapter_type", "?"),
                driver=info.get("description", ""),
                features=sorted(a.features),
                limits=dict(a.limits),
                adapter=a,
            )
        )
    return out


_chosen_adapter: list[str | None] = [None]  # the program's choice (choose_adapter), before ZEROTVM_ADAPTER


def choose_adapter(choice: str | int | None) -> None:
    """The adapter every later Gpu() without one of its own takes (the CLI's --adapter); None: ZEROTVM_ADAPTER or
    the fastest again."""
    _chosen_adapter[0] = None if choice in (None, "") else str(choice)


def pick_adapter(choice: str | int | None = None) -> AdapterInfo:
    """Choose an adapter: by index or name substring (the argument, else choose_adapter's, else ZEROTVM_ADAPTER),
    else the fastest."""
    if choice is None:
        choice = _chosen_adapter[0] if _chosen_adapter[0] is not None else os.environ.get("ZEROTVM_ADAPTER")
    adapters = list_adapters()
    usable = [a for a in adapters if a.backend in GOOD_BACKENDS]
    if choice not in (None, ""):
        text = str(choice)
        if text.isdigit():
            hits = [a for a in adapters if a.index == int(text)]
        else:
            hits = [a for a in usable if text.lower() in a.name.lower()]
        if not hits:
            names = "; ".join(a.summary() for a in adapters) or "none"
            raise GpuError(f"no GPU adapter matches {text!r} (adapters found: {names}); give one of their indices "
                           "or names with --adapter or ZEROTVM_ADAPTER (the app: Settings → GPU), or leave it unset "
                           "to pick the fastest")
        return hits[0]
    if not usable:
        seen = "; ".join(a.summary() for a in adapters) or "none"
        raise GpuError(
            "no Vulkan/Metal/DX12 GPU adapter found (adapters seen: "
            f"{seen}). Install or update your GPU driver; on Linux install the Vulkan loader and driver."
        )
    return min(usable, key=lambda a: (a.software, _TYPE_RANK.get(a.adapter_type, 9), a.index))


_SUBGROUP_PROBE = """
@group(0) @binding(0) var<storage, read_write> out: array<u32>;
@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) i: u32, @builtin(subgroup_size) sg: u32) {
    if (i == 0u) { out[0] = sg; }
}
"""


class Gpu:
    """One wgpu device plus the helpers the engine needs. Not thread-safe: one owner thread."""

    def __init__(self, adapter: str | int | AdapterInfo | None = None, use_subgroups: bool = True):
        """`use_subgroups=False` runs the workgroup-memory reductions even where subgroups exist (the path GPUs
        without them take; the kernel tests run both)."""
        self.info = adapter if isinstance(adapter, AdapterInfo) else pick_adapter(adapter)
        a = self.info.adapter
        if "shader-f16" not in a.features:
            raise GpuError(
                f"this GPU lacks shader-f16: {self.info.summary()} cannot run the f16 kernels. "
                "Update the driver, or pick another adapter with ZEROTVM_ADAPTER."
            )
        wanted = ["shader-f16"]
        self.has_subgroups = "subgroup" in a.features
        if self.has_subgroups:
            wanted.append("subgroup")
        if "timestamp-query" in a.features:
            wanted.append("timestamp-query")
        limit_names = (
            "max-storage-buffer-binding-size",
            "max-buffer-size",
            "max-storage-buffers-per-shader-stage",
            "max-compute-workgroup-storage-size",
            "max-compute-invocations-per-workgroup",
            "max-compute-workgroup-size-x",
        )
        limits = {k: a.limits[k] for k in limit_names if k in a.limits}
        try:
            self.device = a.request_device_sync(
                label="zerotvm-device", required_features=wanted, required_limits=limits
            )
        except Exception as e:  # wgpu raises several types; the message is what matters
            raise GpuError(f"could not open {self.info.summary()}: {e}") from e
        self.queue = self.device.queue
        self.limits = dict(self.device.limits)
        self.features = set(self.device.features)
        self.max_binding = self.limits["max-storage-buffer-binding-size"]
        self._pipelines: dict = {}
        self._pending_upload = 0  # bytes uploaded since the last submission (their staging copies are alive)
        self._reserved: dict[str, list] = {}  # label -> buffers made by reserve(), not yet taken
        self.subgroup_size = self._probe_subgroup_size() if self.has_subgroups else 0
        self.use_subgroups = bool(use_subgroups and self.subgroup_size >= 4)

    # ---- buffers -------------------------------------------------------------------------
    def buffer(self, label: str, size: int, usage=STORAGE):
        size = max(16, (int(size) + 3) // 4 * 4)  # never a zero-size binding
        if (reserved := self._take_reserved(label, size, usage)) is not None:
            return reserved
        return self._create(label, size, usage)

    def _create(self, label: str, size: int, usage):
        if size > self.limits["max-buffer-size"]:
            raise GpuError(f"buffer {label!r} needs {size} bytes; this GPU allows {self.limits['max-buffer-size']}")
        return self.device.create_buffer(label=label, size=size, usage=usage)

    def upload(self, label: str, array: np.ndarray, usage=STORAGE):
        """A buffer holding `array` (padded to whole words): the reserved one of that label and size, else a new one.
        The bytes go through a staging copy that lives until the next submission: past UPLOAD_WINDOW pending bytes
        this waits for the earlier ones to land first."""
        data = np.ascontiguousarray(array)
        if data.nbytes % 4:
            data = np.frombuffer(data.tobytes() + b"\0" * (4 - data.nbytes % 4), np.uint8)
        if data.nbytes == 0:
            data = np.zeros(4, np.uint8)
        if data.nbytes > self.limits["max-buffer-size"]:
            raise GpuError(f"tensor {label!r} is {data.nbytes} bytes; this GPU allows {self.limits['max-buffer-size']}")
        self._stage(data.nbytes)
        if (reserved := self._take_reserved(label, data.nbytes, usage)) is not None:
            self.queue.write_buffer(reserved, 0, data)
            return reserved
        return self.device.create_buffer_with_data(label=label, data=data, usage=usage)

    def upload_at(self, buf, array: np.ndarray, offset: int) -> None:
        """`array` (whole words) written into `buf` at `offset`, staged as upload() stages its bytes (a buffer that
        holds several tensors: engine/blocks/moe.py's paired expert stacks)."""
        data = np.ascontiguousarray(array)
        self._stage(data.nbytes)
        self.queue.write_buffer(buf, offset, data)

    def _stage(self, nbytes: int) -> None:
        """Account for an upload's staging copy: past UPLOAD_WINDOW pending bytes, wait for the earlier ones first."""
        if flushes_before(self._pending_upload, nbytes):
            self.sync()
        self._pending_upload += nbytes

    # ---- reservations --------------------------------------------------------------------
    def reserve(self, needs) -> None:
        """Make the buffers `needs` (engine/blocks BufferNeeds) now, in that order, for the buffer() and upload()
        calls of the same label and size to take. The runtime reserves a model's buffers largest first: wgpu's
        allocator then packs them tightly whatever order the checkpoint streams in (engine/gpu_heap.py)."""
        for need in needs:
            buf = self._create(need.label, need.bytes, USAGE_OF[need.how])
            self._reserved.setdefault(need.label, []).append(buf)

    def _take_reserved(self, label: str, size: int, usage):
        held = self._reserved.get(label, [])
        for i, buf in enumerate(held):
            if buf.size == size and buf.usage == usage:
                return held.pop(i)
        return None

    def release_reserved(self) -> list[str]:
        """Destroy the reserved buffers nobody took; their labels."""
        left = [(label, buf) for label, bufs in self._reserved.items() for buf in bufs]
        self._reserved = {}
        for _, buf in left:
            buf.destroy()
        return [label for label, _ in left]

    def write(self, buf, array: np.ndarray, offset: int = 0) -> None:
        self.queue.write_buffer(buf, offset, np.ascontiguousarray(array))

    def read(self, buf, dtype=np.float32, count: int | None = None, offset: int = 0) -> np.ndarray:
        """Blocking readback (copies through a staging buffer). Doubles as a sync point."""
        itemsize = np.dtype(dtype).itemsize
        size = buf.size - offset if count is None else count * itemsize
        raw = self.queue.read_buffer(buf, offset, size)
        return np.frombuffer(raw, dtype=dtype).copy()

    def wait_map(self, promise) -> None:
        """Block until a buffer mapping (map_async's promise) has landed, through wgpu-py's poll thread. A blocking
        poll on this thread instead (device._poll_wait) measured several times slower on the H200; the streamed
        experts' many short waits poll without blocking (engine/mapping.py PolledMap; BENCH.md)."""
        promise.sync_wait()

    def sync(self) -> None:
        """Wait for all submitted work and pending uploads: read back 4 bytes (a submission, which also flushes
        the uploads' staging copies, then a wait; on_submitted_work_done_sync is broken in wgpu 0.32)."""
        if not hasattr(self, "_sync_buf"):
            self._sync_buf = self.buffer("sync-probe", PROBE_BYTES)
        self.queue.read_buffer(self._sync_buf, 0, 4)
        self._pending_upload = 0

    # ---- pipelines -----------------------------------------------------------------------
    def pipeline(self, shader: str | Kernel, consts: dict | None = None) -> Pipeline:
        """The compute pipeline of a kernel (a Kernel, or the name of shaders/<name>.wgsl) with `consts` injected as
        WGSL constants; built once per (kernel, constants, reduction path). The one pipeline cache of the engine."""
        k = shader if isinstance(shader, Kernel) else kernel(shader)
        consts = with_model_constants(k.source, consts or {})
        key = (k.name, tuple(sorted(consts.items())), self.use_subgroups)  # the reduce lib differs per path
        if key not in self._pipelines:
            k.check_consts(consts)
            module = self.device.create_shader_module(label=k.file, code=build_source(k.name, consts, self))
            built = self.device.create_compute_pipeline(
                label=k.name, layout="auto", compute={"module": module, "entry_point": "main"})
            self._pipelines[key] = Pipeline(k, built, consts)
        return self._pipelines[key]

    def pipeline_from_source(self, label: str, code: str) -> Pipeline:
        """A pipeline from complete WGSL source (bench probes; not cached): its bindings still bind by name."""
        k = Kernel(label, source=code)
        module = self.device.create_shader_module(label=label, code=code)
        return Pipeline(k, self.device.create_compute_pipeline(label=label, layout="auto",
                                                               compute={"module": module, "entry_point": "main"}))

    def bind(self, pipeline: Pipeline, buffers, label: str):
        """Bind group 0 of `pipeline`: `buffers` maps the kernel's binding names to buffers (or (buffer, offset,
        size) ranges); a list binds in the kernel's binding order. Checked against the WGSL declarations."""
        entries = pipeline.kernel.entries(buffers, label)
        return self.device.create_bind_group(label=label, layout=pipeline.wgpu.get_bind_group_layout(0),
                                             entries=entries)

    def _probe_subgroup_size(self) -> int:
        module = self.device.create_shader_module(label="subgroup-probe", code=_SUBGROUP_PROBE)
        pipe = self.device.create_compute_pipeline(
            label="subgroup-probe", layout="auto", compute={"module": module, "entry_point": "main"}
        )
        out = self.buffer("subgroup-probe-out", PROBE_BYTES)
        bg = self.device.create_bind_group(label="subgroup-probe", layout=pipe.get_bind_group_layout(0), entries=[
            {"binding": 0, "resource": {"buffer": out, "offset": 0, "size": out.size}}])
        enc = self.device.create_command_encoder(label="subgroup-probe")
        p = enc.begin_compute_pass(label="subgroup-probe")
        p.set_pipeline(pipe)
        p.set_bind_group(0, bg)
        p.dispatch_workgroups(1)
        p.end()
        self.queue.submit([enc.finish()])
        return int(self.read(out, np.uint32, 1)[0])


class Pipeline:
    """A compute pipeline, the Kernel it was built from (whose declarations its bind groups are checked by) and the
    constants it was built with."""

    __slots__ = ("kernel", "wgpu", "label", "consts")

    def __init__(self, k: Kernel, built, consts: dict | None = None):
        self.kernel, self.wgpu, self.label, self.consts = k, built, k.name, dict(consts or {})

    @property
    def handle(self):
        """wgpu-native's handle, for the raw dispatch calls."""
        return self.wgpu._internal


class DispatchPlan:
    """A run of dispatches kept for replay (a decode step's are the same token after token): the objects, and their
    wgpu-native handles with set_pipeline dropped where the pipeline repeats."""

    def __init__(self, items: list[tuple]):
        self.items = items  # (pipeline, bind group, x, y, z)
        self.raw, last = [], None
        for pipeline, bind_group, x, y, z in items:
            handle = None if pipeline is last or _RAW_PASS_CALLS is None else pipeline.handle
            self.raw.append((handle, bind_group._internal if _RAW_PASS_CALLS else None, x, y, z))
            last = pipeline
        self.last_pipeline = last


class PlanRecorder:
    """Stands in for a Recorder to capture a DispatchPlan; a buffer copy cannot be part of one."""

    def __init__(self):
        self.items: list[tuple] = []
        self.dispatches = 0

    def dispatch(self, pipeline, bind_group, x: int, y: int = 1, z: int = 1) -> None:
        self.items.append((pipeline, bind_group, x, y, z))
        self.dispatches += 1

    def copy(self, *_) -> None:
        raise TypeError("a buffer copy cannot be part of a DispatchPlan")

    def plan(self) -> DispatchPlan:
        return DispatchPlan(self.items)


class SegmentRecorder(PlanRecorder):
    """A PlanRecorder cut into DispatchPlans at tagged points: a streamed MoE decode token, whose routing the host
    reads back between the segments (engine/blocks/expert_cache.py)."""

    def __init__(self):
        super().__init__()
        self.segments: list[tuple[DispatchPlan, object]] = []

    def cut(self, tag) -> None:
        self.segments.append((DispatchPlan(self.items), tag))
        self.items = []

    def plans(self) -> list[tuple[DispatchPlan, object]]:
        """(plan, tag of the cut after it, None for the last)."""
        return [*self.segments, (DispatchPlan(self.items), None)]


class Recorder:
    """Records dispatches into one compute pass and skips redundant set_pipeline calls.

    Dispatches go straight to wgpu-native where wgpu-py allows it: its checked wrappers cost several times more
    host time a call (BENCH.md). `raw=False` takes the checked calls (tests compare the two)."""

    def __init__(self, gpu: Gpu, label: str, timestamp_writes: dict | None = None, raw: bool = True):
        """`timestamp_writes`: WebGPU's pass timestamps (query_set, beginning/end indices), for profiling only."""
        self.gpu = gpu
        self.encoder = gpu.device.create_command_encoder(label=label)
        self.pass_ = self.encoder.begin_compute_pass(label=label, timestamp_writes=timestamp_writes)
        self._raw = _RAW_PASS_CALLS if raw else None
        self._handle = self.pass_._internal if self._raw else None
        self._keep: list = []  # what the pass refers to stays alive until it is submitted
        self._first: list = []  # finished command buffers that go in the same submit, ahead of this one
        self._sealed: list = []  # what seal() finished, submitted next, after _first
        self._pipe = None
        self.dispatches = 0

    def dispatch(self, pipeline, bind_group, x: int, y: int = 1, z: int = 1) -> None:
        if self._raw:
            set_pipeline, set_bind_group, dispatch, null = self._raw
            if pipeline is not self._pipe:
                set_pipeline(self._handle, pipeline.handle)
                self._pipe = pipeline
                self._keep.append(pipeline)
            set_bind_group(self._handle, 0, bind_group._internal, 0, null)
            dispatch(self._handle, x, y, z)
            self._keep.append(bind_group)
        else:
            if pipeline is not self._pipe:
                self.pass_.set_pipeline(pipeline.wgpu)
                self._pipe = pipeline
            self.pass_.set_bind_group(0, bind_group)
            self.pass_.dispatch_workgroups(x, y, z)
        self.dispatches += 1

    def replay(self, plan: DispatchPlan) -> None:
        """The dispatches of `plan`, as if dispatched one by one (a tight loop over pre-resolved handles)."""
        if not self._raw:
            for pipeline, bind_group, x, y, z in plan.items:
                self.dispatch(pipeline, bind_group, x, y, z)
            return
        set_pipeline, set_bind_group, dispatch, null = self._raw
        handle = self._handle
        for pipeline, bind_group, x, y, z in plan.raw:
            if pipeline is not None:
                set_pipeline(handle, pipeline)
            set_bind_group(handle, 0, bind_group, 0, null)
            dispatch(handle, x, y, z)
        self._pipe = plan.last_pipeline
        self._keep.append(plan)
        self.dispatches += len(plan.raw)

    def copy(self, src, src_off: int, dst, dst_off: int, size: int) -> None:
        """A buffer copy; ends the current compute pass and opens a new one after it."""
        self.pass_.end()
        self.encoder.copy_buffer_to_buffer(src, src_off, dst, dst_off, size)
        self.pass_ = self.encoder.begin_compute_pass(label="after-copy")
        self._handle = self.pass_._internal if self._raw else None
        self._pipe = None

    def submit_first(self, command_buffers: list) -> None:
        """Command buffers (finished) that the next submit sends ahead of what this recorder holds, in one
        submission: a streamed layer's expert uploads before the dispatches that read them."""
        self._first += command_buffers

    def submit(self) -> None:
        self.pass_.end()
        self.gpu.queue.submit([*self._first, *self._sealed, self.encoder.finish()])
        self._first.clear()
        self._sealed.clear()
        self._keep.clear()

    def flush(self) -> None:
        """Submit what is recorded so far and go on recording into a fresh encoder (a forward that reads back
        mid-way: the streamed experts' routing)."""
        self.submit()
        self._reopen("after-flush")

    def seal(self) -> None:
        """Finish what is recorded so far into a command buffer for submit_sealed (the encoding work done now, not
        when it is submitted) and go on recording into a fresh encoder."""
        self.pass_.end()
        self._sealed.append(self.encoder.finish())
        self._reopen("after-seal")

    def submit_sealed(self) -> None:
        """Submit the sealed command buffers (after submit_first's); what was recorded since stays open."""
        self.gpu.queue.submit([*self._first, *self._sealed])
        self._first.clear()
        self._sealed.clear()

    def _reopen(self, label: str) -> None:
        self.encoder = self.gpu.device.create_command_encoder(label=label)
        self.pass_ = self.encoder.begin_compute_pass(label=label)
        self._handle = self.pass_._internal if self._raw else None
        self._pipe = None


class MapWait:
    """A read mapping of a MAP_READ buffer, waited for with a cancel check: the wait for the GPU work queued before
    it can be abandoned (Stop, close) without interrupting that work. An abandoned wait stays pending: wait() for
    it again, then release(), before the buffer is used again."""

    def __init__(self, buf, size: int):
        self.buf, self.size = buf, size
        # "READ_NOSYNC": wgpu-py otherwise submits an empty command buffer first (so mapped bytes are fresh), and that
        # submit blocks while the queue is busy: a wait that must stay abandonable cannot afford it. Callers read
        # these bytes only as a fence, never for their content.
        self.promise = buf.map_async("READ_NOSYNC", 0, size)

    def wait(self, cancel=None, poll_s: float = 0.01) -> bool:
        """Block until mapped (True), or until `cancel` (a CancelToken) is set first (False)."""
        # wgpu-native's per-device poll thread sets this event when the mapping lands (wgpu 0.32's GPUPromise).
        event = getattr(self.promise, "_thread_event", None)
        if cancel is not None and event is not None:
            # The Stop is looked at before the mapping: a wait that sees one is abandoned even when the GPU has
            # already finished, so what a Stop leaves queued does not depend on the GPU's speed.
            while not cancel.cancelled:
                if event.wait(poll_s):
                    break
            else:
                return False
        self.promise.sync_wait()
        return True

    def release(self) -> None:
        """Unmap after a completed wait."""
        self.buf.unmap()


class ModelGpu:
    """A Gpu as one model's blocks see it while they build: every pipeline takes the model's values of the
    MODEL_CONSTANTS its kernel reads (engine/shaders.py), so kernels that meet through int8 rows agree on their
    layout. Everything else is the Gpu's own (buffers, the one pipeline cache)."""

    def __init__(self, gpu: Gpu, model: dict):
        unknown = set(model) - set(MODEL_CONSTANTS)
        if unknown:
            raise ValueError(f"not model constants: {', '.join(sorted(unknown))} (have {', '.join(MODEL_CONSTANTS)})")
        self.base, self.model = gpu, dict(model)

    def pipeline(self, shader: str | Kernel, consts: dict | None = None) -> Pipeline:
        k = shader if isinstance(shader, Kernel) else kernel(shader)
        return self.base.pipeline(k, with_model_constants(k.source, consts or {}, self.model))

    def __getattr__(self, name: str):
        return getattr(self.base, name)
