"""Buffer mappings (engine/mapping.py): wgpu-py's, waited for through its poll thread, and wgpu-native's, waited for by
polling on the calling thread, read what the GPU wrote and write what the GPU then copies, in turn on one buffer;
a failed mapping names its buffer."""

import numpy as np
import pytest
import wgpu

from engine import mapping
from engine.errors import GpuError
from engine.gpu import STORAGE
from engine.mapping import PolledMap, ThreadMap, buffer_map

READ = wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST
WRITE = wgpu.BufferUsage.MAP_WRITE | wgpu.BufferUsage.COPY_SRC


@pytest.mark.parametrize("wait", ["thread", "polled"])
def test_mappings_read_and_write_what_the_gpu_copies(gpu, wait):
    rng = np.random.default_rng(0)
    src = gpu.upload("map-src", rng.integers(0, 2**32, 1024, dtype=np.uint32))
    dst = gpu.buffer("map-dst", 4096, STORAGE)
    gpu.write(dst, np.full(1024, 0xDEADBEEF, np.uint32))  # poisoned
    readback = gpu.device.create_buffer(label="map-readback", size=4096, usage=READ)
    staging = gpu.device.create_buffer(label="map-staging", size=4096, usage=WRITE, mapped_at_creation=True)
    r, w = buffer_map(gpu, readback, wait), buffer_map(gpu, staging, wait)
    assert isinstance(r, PolledMap if wait == "polled" else ThreadMap)
    w.mapped_now()
    for round_ in range(3):  # each buffer mapped, used and unmapped in turn, as a streamed token does
        want = rng.integers(0, 2**32, 1024, dtype=np.uint32)
        w.wait()
        view = w.view(0, 4096, True)
        if view is None:
            w.write(want, 0)
        else:
            view[:] = want.view(np.uint8)
        del view
        w.unmap()
        enc = gpu.device.create_command_encoder()
        enc.copy_buffer_to_buffer(staging, 0, dst, 0, 4096)
        enc.copy_buffer_to_buffer(src if round_ == 1 else dst, 0, readback, 0, 4096)
        gpu.queue.submit([enc.finish()])
        r.map("READ_NOSYNC", 0, 4096)
        w.map(wgpu.MapMode.WRITE, 0, 4096)  # lands after the copy out of it
        r.wait()
        got = r.view(0, 4096, False).view(np.uint32).copy()
        r.unmap()
        assert np.array_equal(got, gpu.read(src, np.uint32) if round_ == 1 else want)
    w.wait()
    w.unmap()


def test_a_polled_wait_past_its_spin_blocks_until_the_gpu_is_done(gpu, monkeypatch):
    monkeypatch.setattr(mapping, "SPIN_SECONDS", 0.0)
    readback = gpu.device.create_buffer(label="map-readback", size=256, usage=READ)
    src = gpu.upload("map-src", np.arange(64, dtype=np.uint32))
    enc = gpu.device.create_command_encoder()
    enc.copy_buffer_to_buffer(src, 0, readback, 0, 256)
    gpu.queue.submit([enc.finish()])
    m = PolledMap(gpu, readback)
    m.map(wgpu.MapMode.READ, 0, 256)
    m.wait()
    assert np.array_equal(m.view(0, 256, False).view(np.uint32), np.arange(64))
    m.unmap()


def test_a_failed_polled_mapping_names_the_buffer(gpu):
    readback = gpu.device.create_buffer(label="routing-readback", size=256, usage=READ)
    m = PolledMap(gpu, readback)
    m.map(wgpu.MapMode.READ, 0, 256)
    m.wait()
    again = PolledMap(gpu, readback)
    again.map(wgpu.MapMode.READ, 0, 256)  # already mapped: refused
    with pytest.raises(GpuError, match="routing-readback"):
        again.wait()
    m.unmap()


def test_an_unknown_wait_is_refused(gpu):
    with pytest.raises(ValueError, match="thread, polled"):
        buffer_map(gpu, None, "spin")


def test_a_buffer_destroyed_while_its_polled_mapping_is_pending_is_safe(gpu):
    """The mapping's callback runs at a later poll, after its PolledMap was dropped: it must still be alive then."""
    import gc

    staging = gpu.device.create_buffer(label="map-staging", size=256, usage=WRITE)
    busy = gpu.upload("map-busy", np.zeros(1 << 16, np.float32))
    sink = gpu.buffer("map-sink", 1 << 18, STORAGE)
    enc = gpu.device.create_command_encoder()
    enc.copy_buffer_to_buffer(busy, 0, sink, 0, 1 << 18)
    gpu.queue.submit([enc.finish()])
    m = PolledMap(gpu, staging)
    m.map(wgpu.MapMode.WRITE, 0, 256)
    assert m in mapping._PENDING
    staging.destroy()
    del m
    gc.collect()
    gpu.sync()  # polls: the callback runs now, on the PolledMap kept pending
    assert not [p for p in mapping._PENDING if p.buf is staging]
