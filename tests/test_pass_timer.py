"""engine.bench.PassTimer (bench/kquant_probe.py's clock): a pass's GPU time per dispatch from its timestamps."""

import time

import numpy as np

from engine.bench import PassTimer


def test_pass_timer_times_the_pass_within_its_wall_time_and_runs_the_dispatches(gpu):
    n4 = 1 << 16  # 1 MiB
    src = gpu.upload("src", np.arange(4 * n4, dtype=np.uint32))
    dst = gpu.upload("dst", np.zeros(4 * n4, np.uint32))
    pipe = gpu.pipeline("copy", dict(WG=64, PER_THREAD=4, N4=n4, GRID_X=n4 // 256))
    bg = gpu.bind(pipe, [src, dst], "copy")
    timer = PassTimer(gpu)
    gpu.sync()
    t = time.perf_counter()
    per_dispatch = timer.seconds(pipe, bg, (n4 // 256, 1, 1), 5)
    wall = time.perf_counter() - t
    assert 0 < per_dispatch * 5 <= wall
    np.testing.assert_array_equal(np.frombuffer(gpu.queue.read_buffer(dst), np.uint32), np.arange(4 * n4))
