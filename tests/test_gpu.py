import numpy as np
import pytest

from engine.errors import GpuError
from engine.gpu import Gpu, fold_grid, list_adapters, pick_adapter
from tests.kernel_util import poisoned, read, run, step_uniform


def test_adapter_is_vulkan_with_f16(gpu):
    assert gpu.info.backend == "Vulkan"
    assert "shader-f16" in gpu.features
    # The device carries the adapter's own limits, not WebGPU's 128 MiB defaults.
    assert gpu.max_binding == gpu.info.limits["max-storage-buffer-binding-size"]
    assert gpu.limits["max-buffer-size"] == gpu.info.limits["max-buffer-size"]


def test_subgroup_size_is_probed(gpu):
    assert gpu.subgroup_size in (4, 8, 16, 32, 64, 128)


def test_adapter_choice_by_name_and_index():
    adapters = list_adapters()
    vk = [a for a in adapters if a.backend == "Vulkan"][0]
    assert pick_adapter(str(vk.index)).index == vk.index
    assert pick_adapter(vk.name[:6]).backend in ("Vulkan", "Metal", "D3D12")
    with pytest.raises(GpuError, match="no GPU adapter matches"):
        pick_adapter("no-such-gpu-anywhere")


def test_opengl_adapter_is_refused_for_lack_of_f16():
    gl = [a for a in list_adapters() if a.backend == "OpenGL"]
    if not gl:
        pytest.skip("no OpenGL adapter on this machine to refuse")
    with pytest.raises(GpuError, match="lacks shader-f16"):
        Gpu(gl[0])


def test_fold_grid():
    assert fold_grid(10) == (10, 1)
    for n in (65535, 65536, 151936, 10**6):
        x, y = fold_grid(n)
        assert x <= 65535 and y <= 65535 and x * y >= n


@pytest.mark.parametrize("T,D,q8", [(1, 32, False), (3, 77, False), (5, 3072, False), (1, 64, True), (5, 3072, True)])
def test_rms_norm(any_gpu, rng, T, D, q8):
    from tests.test_kernels_q8 import assert_q8_row

    g = any_gpu
    x = rng.standard_normal((T, D)).astype(np.float32)
    w = rng.standard_normal(D).astype(np.float16)
    y = poisoned(g, "y", (T, D))
    xq, xm = poisoned(g, "xq", (max(D // 4, 1),), np.uint32), poisoned(g, "xm", (max(D // 32, 1), 2))
    run(g, "rms_norm", dict(WG=64, D=D, EPS=1e-5, Q8=q8),
        [g.upload("x", x), g.upload("w", w), y, step_uniform(g, T), xq, xm], (T,))
    xd = x.astype(np.float64)
    ref = xd / np.sqrt((xd**2).mean(1, keepdims=True) + 1e-5) * w.astype(np.float64)
    out = read(g, y, (T, D))
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    assert_q8_row(g, xq, xm, out[-1] if q8 else None)  # the last row in int8, or nothing written
