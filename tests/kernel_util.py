"""Helpers for kernel tests: upload inputs, poison outputs with NaN, dispatch once, read back."""

from __future__ import annotations

import numpy as np

from engine.gpu import UNIFORM, Recorder


def step_uniform(gpu, n_tokens=1, pos0=0, out_index=0, attn_splits=1):
    return gpu.upload("step", np.array([n_tokens, pos0, out_index, attn_splits], np.uint32), usage=UNIFORM)


def poisoned(gpu, label, shape, dtype=np.float32):
    """An output buffer filled with NaN (or 0xFFFFFFFF for ints) so unwritten elements fail the test."""
    fill = np.nan if np.dtype(dtype).kind == "f" else np.iinfo(dtype).max
    return gpu.upload(label, np.full(shape, fill, dtype))


def run(gpu, shader, consts, buffers, grid):
    """Build the pipeline, bind `buffers` in order, dispatch `grid` once and wait."""
    pipe = gpu.pipeline(shader, consts)
    bg = gpu.bind(pipe, buffers, f"test-{shader}")
    rec = Recorder(gpu, f"test-{shader}")
    rec.dispatch(pipe, bg, *grid)
    rec.submit()
    gpu.sync()


def read(gpu, buf, shape, dtype=np.float32):
    return gpu.read(buf, dtype, int(np.prod(shape))).reshape(shape)
