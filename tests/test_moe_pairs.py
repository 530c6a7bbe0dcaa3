"""Paired expert stacks (engine/blocks/moe_pairs.py): on the real Qwen3.6-35B-A3B shapes the allocator model
(engine/gpu_heap.py) loses the half-empty blocks the lone stacks kept; on tiny MLX MoE models every pass that reads a
paired stack (fused and unfused decode, f32 and int8 grouped prefill, the 3-bit stacks' shared-expert views) gives the
same logits, bit for bit, as separate buffers."""

import numpy as np
import pytest

from engine.blocks import DeviceTraits, moe_pairs
from engine.catalog import load_catalog
from engine.gpu_heap import DEVICE_BLOCKS, OPEN_BUFFERS, Heap, pool_of
from engine.memfit import entry_spec
from engine.memfit_stream import entry_formats
from engine.model import load_model
from engine.runtime_options import RuntimeOptions
from engine.transformer import RuntimePlan, moe_block
from tests.helpers import cached_mlx

EVERY_SIZE = (0, 2**40)  # PAIR_RANGE that pairs every stack of whole words (tiny models' too)
NONE = (0, 0)
REAL = moe_pairs.PAIR_RANGE


def real_plan(key: str, monkeypatch, pair_range) -> RuntimePlan:
    monkeypatch.setattr(moe_pairs, "PAIR_RANGE", pair_range)
    entry = {e.key: e for e in load_catalog()}[key]
    spec = entry_spec(entry)
    return RuntimePlan(spec, entry_formats(entry, spec), RuntimeOptions(max_context=6144), DeviceTraits.typical())


def device_unused(plan: RuntimePlan) -> int:
    """Bytes of device-pool blocks no buffer uses once the opened device made every reserved buffer."""
    heap = Heap()
    for size in OPEN_BUFFERS:
        heap.alloc("device", size)
    for n in plan.reserved():
        heap.alloc(pool_of(n.how), n.bytes)
    pool = heap.pools["device"]
    return sum(b.size - b.used for b in pool.blocks if b is not None)


@pytest.mark.parametrize("key, stack", [("qwen3.6-35b-a3b-mlx-4bit", "down"), ("qwen3.6-35b-a3b-mlx-q3", "gate_up")])
def test_real_shapes_pair_the_stacks_that_kept_a_block_each(key, stack, monkeypatch):
    alone = real_plan(key, monkeypatch, NONE)
    paired = real_plan(key, monkeypatch, REAL)
    moe = moe_block(paired)
    assert {(name, k) for _, name, k in moe.pairs} == {(stack, "w")} and len(moe.pairs) == len(moe.layers) == 40
    size = next(n.bytes for n in alone.needs() if n.label == f"layers.0.moe.{stack}.w")
    assert DEVICE_BLOCKS[1] // 2 < size <= DEVICE_BLOCKS[1]
    pair = [n for n in paired.needs() if "+" in n.label]
    assert len(pair) == 20 and all(n.bytes > DEVICE_BLOCKS[1] and n.writes == (size, size) for n in pair)
    # the same bytes of buffers; what the blocks hold beyond them is only the opened device's first block and the
    # last block's tail, where the lone stacks left a block's rest each
    assert sum(n.bytes for n in paired.needs()) == sum(n.bytes for n in alone.needs())
    assert device_unused(paired) < DEVICE_BLOCKS[0] + DEVICE_BLOCKS[1]
    saved = alone.footprint().steady - paired.footprint().steady
    assert saved == device_unused(alone) - device_unused(paired) > 0
    assert paired.footprint().peak < alone.footprint().peak


@pytest.mark.model
@pytest.mark.parametrize("variant, options", [("q4", {}), ("q3exp", {}), ("q4", {"q8_prefill": True}),
                                              ("q3exp", {"q8_prefill": True}), ("q4", {"q8_decode": False})])
def test_paired_stacks_give_the_same_logits(gpu, variant, options, monkeypatch):
    kw = dict(gpu=gpu, max_context=160, prefill_chunk=32, split_keys=48) | options
    ids = np.random.default_rng(3).integers(0, 200, 41)
    out = {}
    for name, pair_range in (("alone", NONE), ("paired", EVERY_SIZE)):
        monkeypatch.setattr(moe_pairs, "PAIR_RANGE", pair_range)
        rt = load_model(cached_mlx(variant), **kw).runtime
        moe = rt.block("moe")
        assert bool(moe.pairs) == (name == "paired") and not rt.unused_reservations
        if moe.pairs:  # the second layer of a pair binds a range past the first's part
            buf, offset, size = moe.w[1]["down"][0]
            assert offset >= size and offset % gpu.limits.get("min-storage-buffer-offset-alignment", 256) == 0
        out[name] = (rt.logits(ids[:40]), rt.logits(ids[40:], chunk=1))
        for b in rt.blocks:  # the next load reuses the memory
            b.release()
    for a, b in zip(out["alone"], out["paired"], strict=True):
        np.testing.assert_array_equal(a, b)


def test_streamed_experts_never_pair(monkeypatch):
    """The expert cache writes its slots by stack (engine/blocks/expert_cache.py): its stacks keep their buffers."""
    monkeypatch.setattr(moe_pairs, "PAIR_RANGE", EVERY_SIZE)
    entry = {e.key: e for e in load_catalog()}["qwen3.6-35b-a3b-mlx-4bit"]
    spec = entry_spec(entry)
    plan = RuntimePlan(spec, entry_formats(entry, spec), RuntimeOptions(max_context=6144, gpu_weights=8 * 10**9),
                       DeviceTraits.typical())
    assert plan.streaming is not None and moe_block(plan).pairs == {}
