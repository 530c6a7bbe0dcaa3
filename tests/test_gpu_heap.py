"""The allocator model (engine/gpu_heap.py): gpu-allocator's rules case by case, then the whole model against the real
allocator, whose blocks of device memory a software adapter makes as anonymous mappings (strace sees them)."""

import json
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from engine.blocks import BufferNeed
from engine.gpu_heap import ALIGN, DEVICE_BLOCKS, HOST_BLOCKS, OPEN_BUFFERS, Heap, Pool, load_footprint

MB = 2**20


def held_blocks(pool: Pool) -> list[int]:
    return [b.size for b in pool.blocks if b is not None]


def test_a_buffer_over_the_block_size_gets_a_block_of_its_own():
    pool = Pool(*DEVICE_BLOCKS)
    pool.alloc(200 * MB + 1)  # over the first block size (128 MiB): its own block, rounded to the alignment
    assert held_blocks(pool) == [200 * MB + ALIGN] and pool.shared == 0
    pool.alloc(MB)  # the first shared block: 128 MiB
    pool.alloc(200 * MB)  # now under the block size (256 MiB once a shared block exists): a shared block of 256
    assert held_blocks(pool) == [200 * MB + ALIGN, 128 * MB, 256 * MB] and pool.shared == 2
    pool.alloc(300 * MB)  # over the largest block size: its own block, at any count of blocks
    assert held_blocks(pool)[-1] == 300 * MB


def test_two_buffers_just_over_half_a_block_take_a_block_each():
    # The waste the runtime's reservation order answers: 128.5 MiB stacks in 256 MiB blocks
    pool = Pool(*DEVICE_BLOCKS)
    pool.alloc(16)
    for _ in range(2):
        pool.alloc(128 * MB + MB // 2)
    assert held_blocks(pool) == [128 * MB, 256 * MB, 256 * MB]
    pool.alloc(127 * MB)  # the gaps take smaller buffers, the newest block first
    assert [b.used for b in pool.blocks] == [ALIGN, 128 * MB + MB // 2, 255 * MB + MB // 2]


def test_best_fit_picks_the_smallest_gap_that_holds_the_buffer():
    pool = Pool(*HOST_BLOCKS)
    handles = [pool.alloc(n * MB) for n in (10, 5, 20, 5)]  # one 64 MiB block: 10 | 5 | 20 | 5 | 24 free
    pool.free(handles[0])
    pool.free(handles[2])  # gaps: 10 at 0, 20 at 15, 24 at 40
    _, (offset, _) = pool.alloc(9 * MB)
    assert offset == 0
    _, (offset, _) = pool.alloc(12 * MB)
    assert offset == 15 * MB


def test_an_empty_block_is_freed_unless_it_is_the_last_shared_one():
    pool = Pool(*HOST_BLOCKS)
    a, b = pool.alloc(60 * MB), pool.alloc(60 * MB)  # two shared blocks: 64 then 128 MiB
    own = pool.alloc(200 * MB)
    assert held_blocks(pool) == [64 * MB, 128 * MB, 200 * MB]
    pool.free(own)
    pool.free(a)
    assert held_blocks(pool) == [128 * MB]
    pool.free(b)
    assert held_blocks(pool) == [128 * MB] and pool.shared == 1  # kept: the pool's last shared block
    assert pool.alloc(100 * MB)[0] == 1  # a freed slot is taken again


def test_a_discrete_gpu_counts_its_device_and_upload_pools_a_cpu_one_pool():
    discrete, cpu = Heap("discrete"), Heap("cpu")
    for heap in (discrete, cpu):
        for pool in ("device", "upload", "readback"):
            heap.alloc(pool, MB)
    assert discrete.gpu_bytes == DEVICE_BLOCKS[0] + HOST_BLOCKS[0]  # the read-back pool is in system RAM
    assert cpu.gpu_bytes == HOST_BLOCKS[0]


def test_a_load_keeps_the_upload_pools_last_block_and_frees_the_rest():
    reserved = [BufferNeed.buffer("w", 100 * MB)]
    uploads = [BufferNeed.upload(f"u{i}", 40 * MB) for i in range(7)]
    foot = load_footprint(reserved, uploads, [], "discrete")
    # The opened device's buffers took the first device block (128 MiB); w fits the rest of it.
    assert foot.open == DEVICE_BLOCKS[0] and sum(OPEN_BUFFERS) + 100 * MB < DEVICE_BLOCKS[0]
    # Staging: u0 opens a 64 MiB block, u1 a 128 MiB one (u2, u3 fit it), u4 a third (128: the size stops
    # doubling), u5 fits it; u6 would pass the 256 MiB window, so the six are flushed first: the two emptied older
    # blocks are freed, the last is kept (u6 goes into it) and stays after the load.
    assert foot.peak == DEVICE_BLOCKS[0] + 64 * MB + 2 * 128 * MB
    assert foot.steady == DEVICE_BLOCKS[0] + 128 * MB


# ---- the model against the real allocator --------------------------------------------------------------------
TRACED = textwrap.dedent("""
    import json, os, sys
    from engine import bench, bench_hybrid, memfit
    from engine.blocks import DeviceTraits
    from engine.gpu import Gpu
    from engine.models.base import DenseSpec, rope_inv_freq
    from engine.runtime_options import RuntimeOptions
    from engine.transformer import Transformer, expected_tensors

    gpu = Gpu()
    gpu.sync()
    if sys.argv[1] == "dense":  # a vocabulary matrix over the largest block: a block of its own
        inv, rot = rope_inv_freq(128, 1e6)
        spec = DenseSpec(2048, 4, 16, 4, 128, 8192, 150000, 1e-6, inv, rot, 4096, False, True)
        spec.names = {c: c for c in expected_tensors(spec)}
        formats, weights = {}, bench.random_weights(spec)
    else:  # expert stacks of a few MiB, 3-bit and 4-bit
        spec, formats = bench_hybrid.make_spec("qwen3_5_moe", dict(
            bench_hybrid._TINY, hidden_size=512, num_experts=64, num_experts_per_tok=4, moe_intermediate_size=512,
            shared_expert_intermediate_size=512, tie_word_embeddings=False, vocab_size=32768, num_hidden_layers=8),
            "mlx", 3)
        weights = bench_hybrid.random_weights(spec, formats)
    options = RuntimeOptions(max_context=2048)
    est = memfit.estimate(spec, 2048, formats=formats, options=options, traits=DeviceTraits.of(gpu))
    os.write(2, b"MARK-LOAD\\n")
    rt = Transformer(gpu, spec, weights, formats=formats, options=options)  # alive at the mark
    os.write(2, b"MARK-END\\n")
    print(json.dumps([est.open_bytes, est.gpu_bytes, est.load_gpu_bytes]))
""")


def device_memory(trace: str) -> tuple[int, int, int]:
    """(before the load, after it, the most during it): bytes of the blocks gpu-allocator mapped (the mmaps under
    MemoryBlock::new: lavapipe allocates a block as malloc'd memory, 8 KiB over its size)."""
    live, before, peak = {}, None, 0
    entries = re.split(r"\n(?! > )", trace)
    for entry in entries:
        head = entry.split("\n", 1)[0]
        if "MARK-LOAD" in head:
            before = sum(live.values())
        if "MARK-END" in head:
            return before, sum(live.values()), peak
        if (m := re.search(r"mmap\(NULL, (\d+),.*= (0x[0-9a-f]+)", head)) and "MemoryBlock::new" in entry:
            live[m[2]] = int(m[1]) - 8192
        elif m := re.search(r"munmap\((0x[0-9a-f]+),", head):
            live.pop(m[1], None)
        if before is not None:
            peak = max(peak, sum(live.values()))
    raise AssertionError("the traced load did not finish")


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["dense", "moe"])
def test_memfit_predicts_the_device_memory_the_real_allocator_holds(gpu, shape, tmp_path):
    if not gpu.info.software or gpu.info.adapter_type != "CPU":
        pytest.skip("the device memory is visible as mappings on a CPU adapter only")
    if not shutil.which("strace") or subprocess.run(["strace", "-k", "-e", "trace=none", "true"],
                                                    capture_output=True).returncode:
        pytest.skip("needs strace with stack traces (-k)")
    out = tmp_path / "trace"
    done = subprocess.run(["strace", "-k", "-f", "-e", "trace=mmap,munmap,write", "-o", str(out), sys.executable,
                           "-c", TRACED, shape], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    opened, gpu_bytes, load_bytes = json.loads(done.stdout.strip().splitlines()[-1])
    assert device_memory(out.read_text()) == (opened, gpu_bytes, load_bytes)
