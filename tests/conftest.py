"""Test session setup: every GPU test runs on a real (software) Vulkan adapter, never OpenGL."""

from __future__ import annotations

import os
import zlib

os.environ.setdefault("WGPU_BACKEND_TYPE", "Vulkan")
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def gpu():
    from engine.gpu import Gpu

    g = Gpu()
    assert g.info.backend == "Vulkan", f"tests need a Vulkan adapter, got {g.info.summary()}"
    return g


@pytest.fixture(params=["subgroup", "workgroup"])
def any_gpu(gpu, request):
    """Runs a kernel test twice: with subgroup reductions and with the workgroup-memory fallback."""
    if request.param == "subgroup" and not gpu.has_subgroups:
        pytest.fail("the test adapter has no subgroup support")
    saved = gpu.use_subgroups
    gpu.use_subgroups = request.param == "subgroup"
    yield gpu
    gpu.use_subgroups = saved


@pytest.fixture
def rng(request):
    # Fresh random data per test, reproducible from the test's name (crc32: str hash() is salted per process).
    seed = zlib.crc32(request.node.nodeid.encode())
    return __import__("numpy").random.default_rng(seed)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: runs WGSL kernels on the Vulkan adapter (lavapipe on CI)")
