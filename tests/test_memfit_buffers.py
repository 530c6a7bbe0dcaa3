"""memfit's buffers are the runtime's: every buffer a loaded model creates (wgpu's create_buffer, wrapped) is one the
plan memfit reads lists, in the order the runtime reserves them, of the planned size, for every architecture and
weight format at two contexts. What the allocator holds around them is engine/gpu_heap.py's (tests/test_gpu_heap.py).
"""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from wgpu.backends.wgpu_native import _api

from engine import memfit
from engine.blocks import DeviceTraits, moe_pairs
from engine.cli import main as cli_main
from engine.model import load_model
from tests.helpers import DIMS, cached_mlx, cached_tiny_hf, gguf_tensors, hf_weights, kquant_raw, write_gguf

pytestmark = [pytest.mark.model, pytest.mark.slow]


def mlc_q4f16_1(tmp_path):
    out = tmp_path / "mlc"
    assert cli_main(["convert", str(cached_tiny_hf("qwen3", vocab_size=290)), str(out), "--format", "q4f16_1"]) == 0
    return out


def gguf(tmp_path, arch: str, qtype):
    """A llama.cpp-layout GGUF of random weights; K-quants as random stored blocks (gguf quantizes no K type)."""
    dims = dict(DIMS, dim=256, ffn=256, head_dim=64)  # whole blocks of every type
    rng = np.random.default_rng(0)
    tensors = gguf_tensors(arch, hf_weights(rng, arch, **dims), **dims)
    if qtype in (Q.Q4_K, Q.Q6_K):
        tensors = {n: (kquant_raw(rng, qtype, *a.shape), qtype) if a.ndim == 2 else a for n, a in tensors.items()}
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, arch, tensors, qtype=qtype, dims=dims)
    return path


CASES = {  # name: (checkpoint maker, load options)
    "dense-mlc-q4f16_1": (mlc_q4f16_1, {}),
    "dense-gguf-q4_0": (lambda tmp: gguf(tmp, "llama", Q.Q4_0), {}),
    "dense-gguf-q4_k": (lambda tmp: gguf(tmp, "qwen3", Q.Q4_K), {}),
    "hybrid-mlx-4bit": (lambda tmp: cached_mlx("dense"), {}),
    "moe-mlx-4bit": (lambda tmp: cached_mlx("q4"), {}),
    "moe-mlx-3bit": (lambda tmp: cached_mlx("q3exp"), {}),
    "moe-mlx-4bit-streamed": (lambda tmp: cached_mlx("q4"), {"streamed": 2}),  # 2 cache slots per layer
    # every layer's expert stacks paired (engine/blocks/moe_pairs.py), as the real Qwen3.6's down / gate_up stacks
    "moe-mlx-4bit-paired": (lambda tmp: cached_mlx("q4"), {"paired": True}),
    "moe-mlx-3bit-paired": (lambda tmp: cached_mlx("q3exp"), {"paired": True}),
}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    make, options = CASES[request.param]
    return make(tmp_path_factory.mktemp(request.param)), options


def streaming_budget(path, gpu, slots: int, context: int) -> int:
    """The weights budget that leaves `slots` expert cache slots per layer."""
    plan = load_model(path, gpu=gpu, max_context=context).runtime.plan
    moe = next(b for b in plan.blocks if b.name == "moe")
    return plan.memory()["weights"] - (moe.E - slots) * moe.routed_expert_bytes()


@pytest.mark.parametrize("context", [64, 200])
def test_memfit_plans_every_buffer_the_runtime_creates(gpu, checkpoint, context, monkeypatch):
    path, options = checkpoint
    if options.get("paired"):
        with pytest.MonkeyPatch.context() as mp:  # for the load and the estimate (monkeypatch is undone between)
            mp.setattr(moe_pairs, "PAIR_RANGE", (0, 2**40))
            assert_memfit_plans_every_buffer(gpu, path, {}, context, monkeypatch, paired=True)
    else:
        assert_memfit_plans_every_buffer(gpu, path, options, context, monkeypatch)


def assert_memfit_plans_every_buffer(gpu, path, options, context, monkeypatch, paired=False):
    kw = {"gpu_weights": streaming_budget(path, gpu, options["streamed"], context)} if options else {}
    gpu.sync()  # the device's own sync buffer exists before counting starts
    made = []
    create = _api.GPUDevice._create_buffer
    monkeypatch.setattr(_api.GPUDevice, "_create_buffer", lambda self, label, size, usage, mapped: (
        made.append((label, size)) or create(self, label, size, usage, mapped)))
    rt = load_model(path, gpu=gpu, max_context=context, **kw).runtime
    monkeypatch.undo()
    assert (rt.plan.streaming is not None) == bool(options)
    assert bool(getattr(rt.block("moe"), "pairs", None)) == paired  # tiny stacks pair only when told
    created = [(label, size) for label, size in made if label]  # wgpu-py's read_buffer makes unlabelled temporaries
    staging = [n for n in rt.plan.needs() if n.how == "staging"]  # the expert stream's, made by the stream itself
    assert created == [(n.label, n.bytes) for n in [*rt.plan.reserved(), *staging]] and not rt.unused_reservations
    est = memfit.estimate(rt.spec, context, formats=rt.formats, options=rt.options, traits=DeviceTraits.of(gpu))
    assert est.buffer_bytes == sum(size for _, size in created) and est.context == context
