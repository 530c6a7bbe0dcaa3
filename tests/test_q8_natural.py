"""int8 activation rows in element order (shaders/q8_codes.wgsl Q8_NATURAL): a model whose int8 products all read
GGUF K-quant blocks writes its rows so, and its K-quant kernels meet the codes as stored instead of reordering bytes
per row. The kernels' own tests take each producer and consumer in both orders (tests/test_kernels_kquant.py,
test_gpu.py, test_kernels_basic.py, test_kernels_norm_rows.py); here: which models get it, that every kernel of a
model is built in the model's order, that the nibble-packed kernels refuse it, and whole models bit for bit."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from engine.bench import shape_spec
from engine.blocks import DeviceTraits
from engine.gpu import ModelGpu
from engine.kernels.matmul import gemm_q8w_plan, matvec_q8_plan, quantize_q8_plan
from engine.model import load_model
from engine.runtime_options import RuntimeOptions
from engine.transformer import RuntimePlan
from tests.helpers import DIMS, gguf_tensors, hf_weights, kquant_raw, write_gguf


def matrix_formats(spec, tag: str, **overrides) -> dict:
    out = {"embed": tag} | ({} if spec.tied_embeddings else {"lm_head": tag})
    for i in range(spec.n_layers):
        out |= {f"layers.{i}.{m}": tag for m in ("qkv", "o", "gate_up", "down")}
    return out | overrides


@pytest.mark.parametrize("shape", ["qwen3-4b", "phi3-mini"])
def test_element_order_where_every_int8_product_reads_k_quant_blocks(shape):
    spec = shape_spec(shape)

    def natural(formats, **options):
        return RuntimePlan(spec, formats, RuntimeOptions(max_context=256, **options), DeviceTraits.typical()).q8_natural

    kq = matrix_formats(spec, "q4_k")
    assert natural(kq)
    # a Q4_K_M file's mix: Q6_K and Q5_0 are K-quant kernels too; Q8_0 and f16 products take f32 activations
    assert natural(matrix_formats(spec, "q4_k", **{"layers.0.down": "q6_k", "layers.1.o": "q5_0",
                                                   "layers.2.qkv": "q8_0", "embed": "q8_0", "lm_head": "f16"}))
    assert not natural(matrix_formats(spec, "q4_k", **{"layers.3.o": "q4_0"}))  # repacked for matvec_q8's order
    assert not natural({})  # MLC q4f16_1
    assert not natural(kq, q8_natural=False)  # the A/B switch
    assert not natural(kq, q8_decode=False)  # no int8 rows at all
    with pytest.raises(ValueError, match="q8_natural must be true or false"):
        RuntimeOptions(q8_natural=1)


@pytest.mark.gpu
def test_a_models_kernels_take_its_int8_order(gpu):
    # Every pipeline a model's blocks build takes the model's Q8_NATURAL if its WGSL reads it (producers and
    # consumers of int8 rows alike), an explicit value wins, kernels that do not read it are built as they are.
    view = ModelGpu(gpu, {"Q8_NATURAL": True})
    assert view.subgroup_size == gpu.subgroup_size and view.base is gpu
    quantize = quantize_q8_plan(64)[0]
    assert view.pipeline("quantize_q8", quantize).consts["Q8_NATURAL"] is True
    assert view.pipeline("quantize_q8", dict(quantize, Q8_NATURAL=False)).consts["Q8_NATURAL"] is False
    assert gpu.pipeline("quantize_q8", quantize).consts["Q8_NATURAL"] is False  # the default, built on its own
    assert "Q8_NATURAL" not in view.pipeline("copy", dict(WG=64, PER_THREAD=1, N4=4, GRID_X=1)).consts
    with pytest.raises(ValueError, match="not model constants: Q8_ORDER"):
        ModelGpu(gpu, {"Q8_ORDER": True})


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["matvec_q8", "matmul_q8w"])
def test_nibble_packed_kernels_refuse_rows_in_element_order(gpu, kernel):
    # Their codes meet matvec_q8's byte order only: built for element order, the shader does not compile.
    fmt = dict(bits=4, zero=8, affine=False, group=32)
    if kernel == "matvec_q8":
        consts = matvec_q8_plan(64, 8, gpu.subgroup_size, **fmt)[0]
    else:
        consts = gemm_q8w_plan(64, 64, 8, **fmt)[0]
    gpu.pipeline(kernel, consts)
    with pytest.raises(Exception, match="const_assert"):
        gpu.pipeline(kernel, dict(consts, Q8_NATURAL=True))


def mixed_kquant_gguf(tmp_path):
    """A llama-layout GGUF in a Q4_K_M-like mix: Q4_K matrices, Q6_K output and one attn_v, Q5_0 and Q8_0 ffn_down
    (llama-quantize's fallbacks), random stored blocks."""
    dims = dict(DIMS, dim=256, ffn=256, head_dim=64)
    rng = np.random.default_rng(7)
    types = {"output.weight": Q.Q6_K, "blk.0.attn_v.weight": Q.Q6_K, "blk.0.ffn_down.weight": Q.Q5_0,
             "blk.1.ffn_down.weight": Q.Q8_0}
    tensors = {}
    for name, a in gguf_tensors("llama", hf_weights(rng, "llama", **dims), **dims).items():
        qtype = types.get(name, Q.Q4_K)
        tensors[name] = (kquant_raw(rng, qtype, *a.shape), qtype) if a.ndim == 2 and qtype != Q.Q8_0 else a
    path = tmp_path / "mix.gguf"
    write_gguf(path, "llama", tensors, qtype=Q.Q8_0, dims=dims)
    return path


@pytest.mark.gpu
@pytest.mark.model
@pytest.mark.parametrize("single_pass_keys", [256, 8])  # 8: decode past 8 keys runs the split-K kernel's combine
def test_a_kquant_model_in_element_order_gives_the_same_logits_and_tokens_bit_for_bit(gpu, tmp_path,
                                                                                      single_pass_keys):
    path = mixed_kquant_gguf(tmp_path)
    ids = np.random.default_rng(1).integers(3, DIMS["vocab"], 40)
    runs = {}
    for natural in (True, False):
        model = load_model(path, gpu=gpu, max_context=128, prefill_chunk=16, q8_prefill=True, q8_natural=natural,
                           single_pass_keys=single_pass_keys)
        rt = model.runtime
        assert rt.plan.q8_natural is natural
        # every kernel of a token and a chunk that reads or writes int8 rows was built in that order
        steps = [item[0] for T in (1, 16) for item in rt.forward_plan(T).items]
        orders = {p.label: p.consts["Q8_NATURAL"] for p in steps if "Q8_NATURAL" in p.consts}
        assert set(orders.values()) == {natural}
        assert {"matvec_kq_q8_wide_vec4", "matmul_kq_q8", "rms_norm", "add_rms_norm", "quantize_q8"} <= set(orders)
        prefill = model.logits(ids)  # int8 GEMMs and the norms' and attention's int8 rows, 16 rows a chunk
        rt.reset()
        per_token = rt.logits(ids[:24], chunk=1)  # the decode matvecs, one token a forward
        rt.reset()
        rt.prefill(ids[:20])
        tokens = [t for batch in rt.decode(0, 24) for t in batch]  # GPU-resident greedy decode
        runs[natural] = prefill, per_token, tokens
        del model, rt
    for ours, theirs in zip(runs[True], runs[False], strict=True):
        np.testing.assert_array_equal(ours, theirs)
