import numpy as np
import pytest

from engine.errors import GpuError
from engine.gpu import Gpu, PlanRecorder, Recorder, copy_buffer, list_adapters, pick_adapter
from engine.kernels import fold_grid
from tests.helpers import assert_q8_row, poisoned, read, run, step_uniform


def test_adapter_is_vulkan_with_f16(gpu):
    assert gpu.info.backend == "Vulkan"
    assert "shader-f16" in gpu.features
    # The device carries the adapter's own limits, not WebGPU's 128 MiB defaults.
    assert gpu.max_binding == gpu.info.limits["max-storage-buffer-binding-size"]
    assert gpu.limits["max-buffer-size"] == gpu.info.limits["max-buffer-size"]


def test_subgroup_size_is_probed(gpu):
    assert gpu.subgroup_size in (4, 8, 16, 32, 64, 128)


@pytest.mark.gpu
def test_adapter_choice_by_name_and_index():
    adapters = list_adapters()
    vk = [a for a in adapters if a.backend == "Vulkan"][0]
    assert pick_adapter(str(vk.index)).index == vk.index
    assert pick_adapter(vk.name[:6]).backend in ("Vulkan", "Metal", "D3D12")
    with pytest.raises(GpuError, match="no GPU adapter matches"):
        pick_adapter("no-such-gpu-anywhere")


@pytest.mark.gpu
def test_opengl_adapter_is_refused_for_lack_of_f16():
    gl = [a for a in list_adapters() if a.backend == "OpenGL"]
    if not gl:
        pytest.skip("no OpenGL adapter on this machine to refuse")
    with pytest.raises(GpuError, match="lacks shader-f16"):
        Gpu(gl[0])


# Workgroups of one dispatch that share a slot run concurrently on a real GPU: they add atomically.
_COUNTER = """
@group(0) @binding(0) var<storage, read_write> o: array<atomic<u32>>;
@compute @workgroup_size(1) fn main(@builtin(workgroup_id) w: vec3<u32>) { atomicAdd(&o[w.x], w.y + 1u); }
"""
_TWO_BUFFERS = """
@group(0) @binding(0) var<storage, read> a: array<u32>;
@group(0) @binding(1) var<storage, read_write> o: array<u32>;
@compute @workgroup_size(1) fn main() { o[0] += a[0]; }
"""


def _pipeline(gpu, code, label):
    return gpu.pipeline_from_source(label, code)


@pytest.mark.parametrize("raw", [True, False])
def test_recorder_dispatches_in_order_and_reports_encoding_errors(gpu, raw):
    # The raw wgpu-native path must record exactly what the checked wgpu-py calls record, across a copy (new
    # pass), and a bad bind group must still raise a validation error naming it, not pass silently.
    counter = _pipeline(gpu, _COUNTER, "counter")
    bufs = [gpu.upload(f"o{i}", np.zeros(4, np.uint32)) for i in range(2)]
    groups = [gpu.bind(counter, [b], f"o{i}") for i, b in enumerate(bufs)]
    rec = Recorder(gpu, "order", raw=raw)
    rec.dispatch(counter, groups[0], 2, 3)  # o0 = [1+2+3, same, 0, 0]
    rec.copy(bufs[0], 0, bufs[1], 8, 8)  # o1[2:4] = o0[0:2]
    rec.dispatch(counter, groups[1], 1)  # o1[0] += 1
    rec.submit()
    assert gpu.read(bufs[0], np.uint32).tolist() == [6, 6, 0, 0]
    assert gpu.read(bufs[1], np.uint32).tolist() == [1, 0, 6, 6]
    wrong = gpu.bind(_pipeline(gpu, _TWO_BUFFERS, "two"), [bufs[0], bufs[1]], "two-buffer-group")
    rec = Recorder(gpu, "bad", raw=raw)
    rec.dispatch(counter, wrong, 1)
    with pytest.raises(Exception, match="two-buffer-group"):
        rec.submit()


@pytest.mark.parametrize("raw", [True, False])
def test_a_replayed_plan_dispatches_what_was_captured(gpu, raw):
    # Replayed twice into one pass, between direct dispatches of another pipeline (the pass's current pipeline
    # must be set again where the plan starts), and once after a copy opened a new pass.
    counter = _pipeline(gpu, _COUNTER, "counter")
    other = _pipeline(gpu, _COUNTER, "counter-2")
    buf = gpu.upload("o", np.zeros(4, np.uint32))
    group, group2 = gpu.bind(counter, [buf], "o"), gpu.bind(other, [buf], "o2")
    cap = PlanRecorder()
    cap.dispatch(counter, group, 1)  # o[0] += 1
    cap.dispatch(counter, group, 2, 2)  # o[0], o[1] += 1 + 2 (y = 0, 1)
    plan = cap.plan()
    assert [p is not None for p, *_ in plan.raw] == [True, False]  # the repeated pipeline is set once
    rec = Recorder(gpu, "replay", raw=raw)
    rec.replay(plan)
    rec.dispatch(other, group2, 4)  # o[0..3] += 1
    rec.replay(plan)
    rec.copy(buf, 0, gpu.buffer("scratch", 16), 0, 16)
    rec.replay(plan)
    rec.submit()
    assert gpu.read(buf, np.uint32).tolist() == [3 * 4 + 1, 3 * 3 + 1, 1, 1] and rec.dispatches == 7
    with pytest.raises(TypeError, match="copy"):
        cap.copy(buf, 0, buf, 0, 4)


def test_sealed_and_first_command_buffers_run_in_order(gpu):
    """Copies into one word: submit_first's command buffers run before the sealed ones, the sealed before what is
    still open; submit_sealed leaves the open part for the next submit."""
    src = [gpu.upload(f"src{v}", np.array([v], np.uint32)) for v in range(4)]
    dst = gpu.buffer("dst", 4)
    word = lambda: int(gpu.read(dst, np.uint32, 1)[0])  # noqa: E731

    def first_copying(v):
        enc = gpu.device.create_command_encoder()
        enc.copy_buffer_to_buffer(src[v], 0, dst, 0, 4)
        return enc.finish()

    rec = Recorder(gpu, "order")
    rec.copy(src[1], 0, dst, 0, 4)
    rec.seal()
    rec.copy(src[2], 0, dst, 0, 4)  # open: not in submit_sealed
    rec.submit_first([first_copying(3)])
    rec.submit_sealed()
    assert word() == 1
    rec.submit_first([first_copying(0)])
    rec.submit()
    assert word() == 2


def test_copy_buffer_moves_the_bytes_and_a_bad_copy_fails_at_finish(gpu, rng):
    """The unchecked copy (expert uploads) writes exactly its range; a misaligned one is still reported."""
    src = gpu.upload("copy-src", rng.integers(0, 2**32, 64, dtype=np.uint32))
    dst = gpu.upload("copy-dst", np.full(64, 0xDEADBEEF, np.uint32))
    enc = gpu.device.create_command_encoder()
    copy_buffer(enc, src, 16, dst, 64, 32)
    gpu.queue.submit([enc.finish()])
    want = np.full(64, 0xDEADBEEF, np.uint32)
    want[16:24] = read(gpu, src, 64, np.uint32)[4:12]
    np.testing.assert_array_equal(read(gpu, dst, 64, np.uint32), want)
    enc = gpu.device.create_command_encoder()
    copy_buffer(enc, src, 2, dst, 0, 8)
    with pytest.raises(Exception, match="(?i)align"):
        enc.finish()


def test_fold_grid():
    assert fold_grid(10) == (10, 1)
    for n in (65535, 65536, 151936, 10**6):
        x, y = fold_grid(n)
        assert x <= 65535 and y <= 65535 and x * y >= n


# natural: the int8 row in element order (shaders/q8_codes.wgsl Q8_NATURAL, a model of K-quant products)
@pytest.mark.parametrize("T,D,q8,natural", [(1, 32, False, False), (3, 77, False, False), (5, 3072, False, False),
                                            (1, 64, True, False), (5, 3072, True, False), (1, 64, True, True),
                                            (5, 3072, True, True)])
def test_rms_norm(any_gpu, rng, T, D, q8, natural):
    g = any_gpu
    x = rng.standard_normal((T, D)).astype(np.float32)
    w = rng.standard_normal(D).astype(np.float16)
    y = poisoned(g, "y", (T, D))
    xq, xm = poisoned(g, "xq", (max(D // 4, 1),), np.uint32), poisoned(g, "xm", (max(D // 32, 1), 2))
    run(g, "rms_norm", dict(WG=64, D=D, EPS=1e-5, Q8=q8, NORM_OFFSET=0.0, Q8_NATURAL=natural),
        [g.upload("x", x), g.upload("w", w), y, step_uniform(g, T), xq, xm], (T,))
    xd = x.astype(np.float64)
    ref = xd / np.sqrt((xd**2).mean(1, keepdims=True) + 1e-5) * w.astype(np.float64)
    out = read(g, y, (T, D))
    # Σx² over D ≤ 3072 positive terms: ≤ (D − 1)·2^-24 relative, halved by the root (inverseSqrt: 2 ULP)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    assert_q8_row(g, xq, xm, out[-1] if q8 else None, natural)  # the last row in int8, or nothing written


def test_uploads_wait_for_their_staging_copies_past_one_window(gpu, monkeypatch):
    # Each upload's bytes stay in a staging copy until a submission: past UPLOAD_WINDOW pending bytes the next
    # upload first syncs, so a load holds one window of staging memory, not the whole model's.
    import engine.gpu

    monkeypatch.setattr(engine.gpu, "UPLOAD_WINDOW", 1024)
    gpu.sync()
    real, syncs = gpu.sync, []
    monkeypatch.setattr(gpu, "sync", lambda: syncs.append(1) or real())
    bufs = [gpu.upload(f"u{i}", np.full(100, i, np.uint32)) for i in range(25)]  # 400 bytes: 2 fit a window
    big = gpu.upload("big", np.arange(1000, dtype=np.uint32))  # bigger than the window: goes alone
    assert len(syncs) == 12 + 1
    assert all(gpu.read(b, np.uint32).tolist() == [i] * 100 for i, b in enumerate(bufs))
    assert gpu.read(big, np.uint32).tolist() == list(range(1000))


@pytest.mark.parametrize("info,software", [
    ({"adapter_type": "CPU", "device": "Some Vendor Device", "backend_type": "Vulkan"}, True),
    ({"adapter_type": "CPU", "device": "llvmpipe (LLVM 15.0.6, 256 bits)", "description": "Mesa 22.3.6"}, True),
    ({"adapter_type": "IntegratedGPU", "device": "lavapipe", "description": ""}, True),
    ({"adapter_type": "Unknown", "device": "SwiftShader Device (Subzero)", "vendor": "Google"}, True),
    ({"adapter_type": "DiscreteGPU", "device": "Microsoft Basic Render Driver", "backend_type": "D3D12"}, True),
    ({"adapter_type": "Unknown", "device": "WARP", "description": "Microsoft WARP adapter"}, True),
    ({"adapter_type": "DiscreteGPU", "device": "NVIDIA H200", "description": "565.57.01"}, False),
    ({"adapter_type": "IntegratedGPU", "device": "Apple M2 Pro", "vendor": "apple"}, False),
    ({"adapter_type": "DiscreteGPU", "device": "AMD Radeon RX 7900 XTX (RADV NAVI31)", "description": "Mesa"}, False),
    ({"adapter_type": "IntegratedGPU", "device": "Intel(R) Iris(R) Xe Graphics (Warpath test rig)"}, False),
])
def test_software_adapters_are_recognised(info, software):
    from engine.gpu import AdapterInfo, is_software_adapter

    assert is_software_adapter(info) is software
    as_info = AdapterInfo(0, info["device"], info.get("backend_type", "Vulkan"), info["adapter_type"],
                          info.get("description", ""), [], {})
    assert as_info.software is software


def test_a_software_adapter_is_picked_last(monkeypatch):
    import engine.gpu
    from engine.gpu import AdapterInfo

    fake = [AdapterInfo(0, "SwiftShader Device", "Vulkan", "IntegratedGPU", "", ["shader-f16"], {}),
            AdapterInfo(1, "Intel(R) UHD Graphics 630", "Vulkan", "IntegratedGPU", "", ["shader-f16"], {})]
    monkeypatch.setattr(engine.gpu, "list_adapters", lambda: fake)
    monkeypatch.delenv("ZEROTVM_ADAPTER", raising=False)
    assert pick_adapter().index == 1
