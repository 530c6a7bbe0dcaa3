"""Memory fit (engine/memfit.py) and system RAM (engine/sysmem.py): known numbers, a real allocation, verdicts."""

from dataclasses import replace

import pytest

from engine import memfit
from engine.blocks import DeviceTraits
from engine.catalog import load_catalog
from engine.gpu import UPLOAD_WINDOW, AdapterInfo
from engine.memfit import (
    LOAD_COPIES,
    RAM_BASELINE_BYTES,
    TIGHT_MARGIN,
    check_fit,
    estimate,
    gpu_memory,
)
from engine.memfit_stream import entry_formats
from engine.models import model_module
from engine.runtime_options import RuntimeOptions
from engine.sysmem import SystemMemory, parse_meminfo, parse_vm_stat, system_memory
from engine.transformer import Transformer, expected_tensors
from tests.helpers import spec_from_dims

MEMINFO = """\
MemTotal:       16318452 kB
MemFree:         1203384 kB
MemAvailable:    9876544 kB
Buffers:          412000 kB
Cached:          7000000 kB
SwapCached:            0 kB
HugePages_Total:       0
Hugepagesize:       2048 kB
"""

VM_STAT = """\
Mach Virtual Memory Statistics: (page size of 16384 bytes)
Pages free:                               12345.
Pages active:                            400000.
Pages inactive:                          300000.
Pages speculative:                         5000.
Pages throttled:                              0.
Pages wired down:                        150000.
Pages purgeable:                           2000.
"Translation faults":                 123456789.
"""


@pytest.fixture(scope="module")
def models():
    return {e.key: e for e in load_catalog()}


# ---- known numbers ------------------------------------------------------------------------------------
def test_phi3_kv_cache_at_4096(models):
    est = estimate(models["phi3-mini-4k-q4f16_1"], 4096)
    assert est.kv_bytes == 2 * 32 * 32 * 96 * 2 * 4096 == 1_610_612_736
    assert est.weights_bytes == 2_149_644_288 and est.state_bytes == 0 and not est.approximate
    assert est.buffer_bytes == est.weights_bytes + est.kv_bytes + est.scratch_bytes
    assert est.gpu_bytes == est.buffer_bytes + est.overhead_bytes


def test_qwen3_kv_per_token_and_default_context(models):
    qwen = models["qwen3-4b-q4f16_1"]
    assert estimate(qwen, 1).kv_bytes == 16 * 147_456  # one page of 16 tokens is the smallest cache
    assert estimate(qwen).kv_bytes == 147_456 * 7168


def test_context_rounds_up_to_pages_and_stops_at_the_models_window(models):
    phi3 = models["phi3-mini-4k-q4f16_1"]
    assert estimate(phi3, 4081).kv_bytes == estimate(phi3, 4096).kv_bytes  # 256 pages either way
    assert estimate(phi3, 100_000).context == 4096


def test_hybrids_count_kv_on_full_attention_layers_only(models):
    q35 = estimate(models["qwen3.5-4b-q4f16_1"], 32768)
    assert q35.kv_bytes == 2 * 8 * 4 * 256 * 2 * 32768 == 2**30
    # f32 recurrent state + f32 conv window per GDN layer (each on a 256-byte offset), and 2 + 3 rollback snapshots
    assert q35.state_bytes == 24 * (32 * 128 * 128 * 4 + 3 * 8192 * 4) * 6
    q36 = estimate(models["qwen3.6-35b-a3b-mlx-q3"])
    assert q36.kv_bytes == 20_480 * 6144 and q36.approximate


def test_load_ram_is_baseline_plus_largest_tensor(models):
    qwen = models["qwen3-4b-q4f16_1"]
    assert estimate(qwen).load_ram_bytes == RAM_BASELINE_BYTES + LOAD_COPIES * 194_478_080


def test_entry_and_spec_estimates_agree_for_dense_models(models):
    for key in ("phi3-mini-4k-q4f16_1", "qwen3-4b-q4f16_1"):
        e = models[key]
        a, b = estimate(e, 2048, max_binding=2**31), estimate(spec_from_dims(e), 2048, max_binding=2**31)
        assert (a.weights_bytes, a.kv_bytes, a.scratch_bytes) == (b.weights_bytes, b.kv_bytes, b.scratch_bytes)


def tiny_dense_spec():
    module = model_module("qwen3")
    spec = module.spec(module.ModelArgs.from_dict(dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, vocab_size=512, max_position_embeddings=256)))
    spec.names = {c: c for c in expected_tensors(spec)}  # random weights under canonical names
    return spec, {}


RUNTIME_SHAPES = {  # every block and variant the runtime builds: dense, hybrid, MoE stacked / apart / 3-bit
    "dense": tiny_dense_spec, "hybrid": "tiny-hybrid", "moe": "tiny-hybrid-moe", "moe-3bit": "tiny-hybrid-moe-3bit"}
OPTIONS = {"int8": {}, "f32": {"q8_decode": False}, "int8-prefill": {"q8_prefill": True, "prefill_chunk": 48},
           "few-snapshots": {"state_snapshots": (1, 0), "split_keys": 16}}


@pytest.mark.parametrize("setting", list(OPTIONS))
@pytest.mark.parametrize("shape", list(RUNTIME_SHAPES))
def test_estimate_matches_what_the_runtime_allocates(gpu, shape, setting):
    """Every byte the runtime allocates (weights, KV pages, state and snapshots, activations, logits, sampler) is
    what memfit predicts from the blocks' plan, for every runtime shape and setting."""
    from engine import bench, bench_hybrid

    made = RUNTIME_SHAPES[shape]
    if callable(made):
        spec, formats = made()
        weights = bench.random_weights(spec)
    else:
        spec, formats = bench_hybrid.hybrid_spec(made)
        weights = bench_hybrid.random_weights(spec, formats)
    options = RuntimeOptions.of(max_context=100, **OPTIONS[setting])
    gpu.sync()  # the device's own sync buffer exists before counting starts
    sizes = []
    orig_buffer, orig_upload = gpu.buffer, gpu.upload
    gpu.buffer = lambda *a, **k: sizes.append(b := orig_buffer(*a, **k)) or b
    gpu.upload = lambda *a, **k: sizes.append(b := orig_upload(*a, **k)) or b
    try:
        rt = Transformer(gpu, spec, weights, formats=formats, options=options)
    finally:
        del gpu.buffer, gpu.upload  # back to the class methods
    est = estimate(spec, 100, formats=formats, options=options, traits=DeviceTraits.of(gpu))
    assert est.buffer_bytes == sum(b.size for b in sizes) and est.context == 100
    by_kind = {k: sum(b[k] for b in rt.report()) for k in ("weights", "kv", "state", "scratch")}
    assert by_kind == {"weights": est.weights_bytes, "kv": est.kv_bytes, "state": est.state_bytes,
                       "scratch": est.scratch_bytes}
    assert (est.state_bytes > 0) == (shape != "dense")


def test_gpu_bytes_are_the_allocators_blocks_around_the_buffers(models):
    # The tiny model's buffers all fit the opened device's first block (128 MiB); its uploads' staging copies fit
    # the upload pool's first block (64 MiB), which stays after the load (engine/gpu_heap.py): nothing more to stage.
    tiny = estimate(tiny_dense_spec()[0], 64)
    assert tiny.open_bytes == 128 * 2**20 and tiny.gpu_bytes == (128 + 64) * 2**20 and tiny.staging_bytes == 0
    assert tiny.overhead_bytes == tiny.gpu_bytes - tiny.buffer_bytes
    for e in models.values():  # the allocator never holds less than the buffers, nor stages more than a window
        est = estimate(e)
        assert est.overhead_bytes > 0 and 0 <= est.staging_bytes <= UPLOAD_WINDOW + 2 * e.largest_tensor_bytes


# ---- verdicts -------------------------------------------------------------------------------------------
def fake_entry(models, **changes):
    return replace(models["qwen3-4b-q4f16_1"], **changes)


def test_verdict_thresholds(models):
    e = fake_entry(models)
    need = estimate(e).load_ram_bytes
    ram = lambda avail: SystemMemory(64 * 10**9, avail)  # noqa: E731
    gpu_need = estimate(e).gpu_bytes
    assert check_fit(e, system=ram(10 * need), gpu_bytes_available=10 * gpu_need).verdict == "ok"
    # Exactly at the margin is still ok; a byte past it is tight; past the available amount will not fit.
    edge = int(gpu_need / (1 - TIGHT_MARGIN)) + 1
    assert check_fit(e, system=ram(10 * need), gpu_bytes_available=edge).verdict == "ok"
    assert check_fit(e, system=ram(10 * need), gpu_bytes_available=gpu_need + 1).verdict == "tight"
    assert check_fit(e, system=ram(10 * need), gpu_bytes_available=gpu_need - 1).verdict == "wont_fit"
    assert check_fit(e, system=ram(need - 1), gpu_bytes_available=10 * gpu_need).verdict == "wont_fit"
    tight = check_fit(e, system=ram(need + 1), gpu_bytes_available=10 * gpu_need)
    assert tight.verdict == "tight" and tight.load_anyway and not tight.ram_warning


def test_unknown_gpu_memory_and_shared_memory(models):
    e = fake_entry(models)
    plenty = SystemMemory(64 * 10**9, 32 * 10**9)
    discrete = check_fit(e, system=plenty)
    assert discrete.verdict == "unknown" and discrete.gpu_available is None and not discrete.load_anyway
    assert "does not report" in discrete.message
    shared = check_fit(e, system=plenty, shared_memory=True)
    assert shared.verdict == "ok" and shared.ram_needed == shared.estimate.load_ram_bytes + shared.gpu_needed
    small = check_fit(e, system=SystemMemory(8 * 10**9, shared.ram_needed - 1), shared_memory=True)
    assert small.verdict == "wont_fit"
    assert check_fit(e, system=SystemMemory(None, None), shared_memory=True).verdict == "unknown"


def test_message_speaks_gb(models):
    r = check_fit(models["phi3-mini-4k-q4f16_1"], 4096, system=SystemMemory(16 * 10**9, 12_300_000_000),
                  gpu_bytes_available=8 * 10**9)
    assert r.verdict == "ok"
    assert f"{r.gpu_needed / 1e9:.1f} GB of GPU memory" in r.message
    assert "12.3 GB of RAM is free" in r.message and "8.0 GB free" in r.message and "4096 tokens" in r.message


def test_qwen36_ram_warning(models):
    q3, q4 = models["qwen3.6-35b-a3b-mlx-q3"], models["qwen3.6-35b-a3b-mlx-4bit"]
    big_gpu = 200 * 10**9
    low = check_fit(q3, system=SystemMemory(32 * 10**9, 19 * 10**9), gpu_bytes_available=big_gpu)
    assert low.ram_warning and low.load_anyway and low.verdict == "tight"  # would be ok on the numbers alone
    assert "20.0 GB of free RAM" in low.message and low.summary == "tight (needs 20.0 GB of RAM, 19.0 GB free)"
    mid = SystemMemory(32 * 10**9, 22 * 10**9)
    assert not check_fit(q3, system=mid, gpu_bytes_available=big_gpu).ram_warning
    assert check_fit(q4, system=mid, gpu_bytes_available=big_gpu).ram_warning
    assert check_fit(q4, system=SystemMemory(None, None)).ram_warning  # unknown RAM: warn
    assert not check_fit(models["qwen3-4b-q4f16_1"], system=SystemMemory(8 * 10**9, 10**9)).ram_warning


# ---- system and GPU memory ---------------------------------------------------------------------------------
def test_parse_meminfo():
    mem = parse_meminfo(MEMINFO)
    assert (mem.total_bytes, mem.available_bytes) == (16318452 * 1024, 9876544 * 1024)
    old = parse_meminfo(MEMINFO.replace("MemAvailable:    9876544 kB\n", ""))  # kernels before 3.14
    assert old.available_bytes == (1203384 + 7000000 + 412000) * 1024
    assert parse_meminfo("garbage") == SystemMemory(None, None, "/proc/meminfo")


def test_parse_vm_stat():
    mem = parse_vm_stat(VM_STAT, total=32 * 2**30)
    assert mem.total_bytes == 32 * 2**30
    assert mem.available_bytes == (12345 + 300000 + 5000 + 2000) * 16384
    assert parse_vm_stat("nothing here").available_bytes is None


def test_system_memory_on_this_machine():
    mem = system_memory()
    if mem.total_bytes is not None:
        assert mem.total_bytes > 0 and 0 <= mem.available_bytes <= mem.total_bytes


def test_gpu_memory_is_unknown_unless_shared():
    assert gpu_memory("IntegratedGPU").shared and gpu_memory("CPU").shared
    discrete = gpu_memory(AdapterInfo(0, "GPU", "Vulkan", "DiscreteGPU", "", [], {}))
    assert discrete.total_bytes is None and not discrete.shared and "does not report" in discrete.note
    assert memfit.system_memory is system_memory  # re-exported for callers of memfit


# ---- decode bytes and the software-adapter verdict ------------------------------------------------------------
def test_decode_reads_all_weights_but_the_embedding_table_and_the_unrouted_experts(models):
    # q4f16_1 stores 4 bits a weight plus an f16 scale per 32: 9/16 of a byte.
    demo = estimate(models["smollm2-135m-demo"])  # tied: the table is also the head, read whole
    assert demo.decode_bytes == demo.weights_bytes
    phi3 = models["phi3-mini-4k-q4f16_1"]
    d = phi3.dims
    assert estimate(phi3).decode_bytes == phi3.weights_bytes - d["vocab_size"] * d["hidden_size"] * 9 // 16
    q4 = models["qwen3.6-35b-a3b-mlx-4bit"]
    d, moe = q4.dims, q4.dims["moe"]
    q4f16_1 = 19_498_264_576  # the plan's weights for these dims in q4f16_1 (RuntimePlan.memory()["weights"])
    spec = memfit.entry_spec(q4)
    plan = lambda formats: memfit.RuntimePlan(spec, formats, RuntimeOptions.of(None), DeviceTraits.typical(None))  # noqa: E731
    assert plan(None).memory()["weights"] == q4f16_1
    # The MLX build's own formats: 4-bit with a (scale, bias) pair per 64 is 9/16 of a byte a weight, as q4f16_1;
    # the router (256 experts + the shared expert's gate, 8-bit) takes half a byte more a weight.
    plan_total = q4f16_1 + d["num_layers"] * (moe["experts"] + 1) * d["hidden_size"] // 2
    assert plan(entry_formats(q4, spec)).memory()["weights"] == plan_total
    # The shared expert is stacked as expert 257 and always runs: 8 + 1 of 257 experts read per token.
    stacks = d["num_layers"] * (moe["experts"] + 1) * 3 * d["hidden_size"] * d["ffn_dim"] * 9 // 16
    embed = d["vocab_size"] * d["hidden_size"] * 9 // 16
    read = plan_total - embed - stacks + stacks * (moe["top_k"] + 1) / (moe["experts"] + 1)
    assert estimate(q4).decode_bytes == round(q4.weights_bytes * read / plan_total)


def test_a_software_adapter_makes_every_model_slow_and_big_ones_too_slow(models):
    from engine.speed import SOFTWARE_BYTES_PER_S_PER_CORE, TOO_SLOW_TPS

    plenty = SystemMemory(256 * 10**9, 200 * 10**9)
    demo = check_fit(models["smollm2-135m-demo"], system=plenty, shared_memory=True, software=True, cores=2)
    tps = 2 * SOFTWARE_BYTES_PER_S_PER_CORE / demo.estimate.decode_bytes
    assert demo.memory_verdict == "ok" and demo.verdict == "slow" and not demo.load_anyway
    assert demo.speed.tokens_per_s == pytest.approx(tps) and tps >= TOO_SLOW_TPS
    assert demo.summary == f"fits ({demo.ram_needed / 1e9:.1f} GB of RAM) · slow (about {tps:.1f} tokens/s)"
    assert f"roughly {tps:.1f} tokens/s" in demo.message
    big = check_fit(models["qwen3.6-35b-a3b-mlx-4bit"], system=plenty, shared_memory=True, software=True, cores=2)
    assert big.memory_verdict == "ok" and big.verdict == "too_slow" and big.load_anyway  # never "ok"
    assert "too slow to use" in big.message and big.summary.endswith(
        f"too slow (one token every {big.estimate.decode_bytes / (2 * SOFTWARE_BYTES_PER_S_PER_CORE):.1f} s)")
    # More cores, faster; past MAX_CORES no faster. Memory still wins when it is worse than speed.
    many = check_fit(models["phi3-mini-4k-q4f16_1"], system=plenty, shared_memory=True, software=True, cores=64)
    assert many.verdict == "slow" and many.speed.tokens_per_s == pytest.approx(
        16 * SOFTWARE_BYTES_PER_S_PER_CORE / many.estimate.decode_bytes)
    short = check_fit(models["smollm2-135m-demo"], system=SystemMemory(8 * 10**9, 10**8), shared_memory=True,
                      software=True, cores=2)
    assert short.verdict == "wont_fit" and short.summary.startswith("does not fit (needs ")
    assert check_fit(models["smollm2-135m-demo"], system=plenty).speed is None  # a real GPU: no speed verdict


def test_a_measured_rate_replaces_the_estimate(models, tmp_path):
    from engine.speed import MIN_MEASURED_TOKENS, measured_rate, record_decode, software_notice

    demo = models["smollm2-135m-demo"]
    bytes_ = estimate(demo).decode_bytes
    assert record_decode("Vulkan|llvmpipe|Mesa", bytes_, MIN_MEASURED_TOKENS - 1, 9.0, tmp_path) is None  # too short
    assert measured_rate("Vulkan|llvmpipe|Mesa", tmp_path) is None
    assert record_decode("Vulkan|llvmpipe|Mesa", bytes_, 40, 9.0, tmp_path) == bytes_ * 9.0
    rate = measured_rate("Vulkan|llvmpipe|Mesa", tmp_path)
    plenty = SystemMemory(256 * 10**9, 200 * 10**9)
    fit = check_fit(demo, system=plenty, shared_memory=True, software=True, decode_rate=rate)
    assert fit.speed.measured and fit.speed.tokens_per_s == pytest.approx(9.0)
    assert "roughly 9.0 tokens/s (from the speed measured on this computer)" in fit.message
    q4 = check_fit(models["qwen3-4b-q4f16_1"], system=plenty, shared_memory=True, software=True, decode_rate=rate)
    assert q4.speed.tokens_per_s == pytest.approx(rate / q4.estimate.decode_bytes)  # the same bytes/s, more bytes
    assert "measured on this computer" in software_notice("llvmpipe", rate=rate)
    (tmp_path / "speeds.json").write_text("[" * 10_000)  # damaged: forgotten, and written afresh next time
    assert measured_rate("Vulkan|llvmpipe|Mesa", tmp_path) is None
    assert record_decode("Vulkan|llvmpipe|Mesa", bytes_, 40, 3.0, tmp_path) == bytes_ * 3.0


def test_the_background_fill_leaves_the_picker_nothing_to_plan(models, monkeypatch):
    """On a GPU of known size a MoE model's verdict also needs its streaming plan (auto_weights' search): fill_fits
    (the picker's background thread) works it out with the same GPU size, so model_rows on the GUI thread plans
    nothing; fit_is_quick is false until then."""
    from app.model_list import fill_fits, model_rows
    from engine import memfit_stream

    monkeypatch.setattr(memfit, "_ESTIMATES", {})
    monkeypatch.setattr(memfit, "_STREAM_FITS", {})
    moe, gpu = models["qwen3.6-35b-a3b-mlx-4bit"], 8 * 2**30
    memfit.check_fit(moe, moe.default_context)  # the estimate alone, as a fill without the GPU's size made it
    assert memfit.fit_is_quick(moe, moe.default_context) and not memfit.fit_is_quick(moe, moe.default_context, gpu)
    rows = model_rows(context=0, quick_only=True, gpu_bytes=gpu)
    assert next(r for r in rows if r.entry.key == moe.key).fit_pending
    fill_fits(rows, 0, gpu)
    assert memfit.fit_is_quick(moe, moe.default_context, gpu)
    planned = []
    monkeypatch.setattr(memfit_stream, "stream_fit", lambda *a: planned.append(a))
    monkeypatch.setattr(memfit, "estimate", lambda *a, **k: planned.append(a))
    rows = model_rows(context=0, quick_only=True, gpu_bytes=gpu)
    row = next(r for r in rows if r.entry.key == moe.key)
    # the streaming plan is in the verdict (whether RAM then suffices depends on this machine), none planned here
    assert not row.fit_pending and row.fit.stream is not None and row.fit.stream.slots > 0 and planned == []
