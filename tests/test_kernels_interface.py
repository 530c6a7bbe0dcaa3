"""Kernels described once (engine/kernels): every WGSL file's bindings and uniform structs parse, the host's
declarations agree with them, and a mismatch between host and kernel is an error naming both sides."""

import numpy as np
import pytest

from engine.gpu import UNIFORM
from engine.kernels import Kernel, KernelInterfaceError, kernel, step_struct, uniform_struct
from engine.resources import root

# Kernels have an entry point; the other WGSL files are libraries they #import.
KERNELS = sorted(p.stem for p in (root() / "shaders").glob("*.wgsl") if "@compute" in p.read_text())


@pytest.mark.parametrize("name", KERNELS)
def test_every_kernel_parses_and_agrees_with_its_host_declaration(name):
    k = kernel(name)
    bindings = k.bindings  # raises if the host's `writes` disagree with the declared access
    assert [b.index for b in bindings.values()] == list(range(len(bindings)))
    for b in bindings.values():
        if b.space == "uniform":
            assert k.uniform(b.name).size % 16 == 0


def test_every_kernel_is_declared_by_a_family_module():
    # A kernel the runtime binds has its host expectations written down next to its plan (engine/kernels/*.py);
    # only the bench's copy kernel has none.
    undeclared = [name for name in KERNELS if not kernel(name).writes]
    assert undeclared == ["copy"]


def test_uniform_structs_pack_by_name():
    step = step_struct()
    assert list(step.fields) == ["n_tokens", "pos0", "out_index", "attn_splits"] and step.size == 16
    packed = step.pack(n_tokens=3, pos0=7, out_index=9, attn_splits=2)
    assert packed.view(np.uint32).tolist() == [3, 7, 9, 2]
    params = uniform_struct("sample_params", "SampleParams")
    raw = params.pack(inv_temp=0.5, top_k=4, top_p=0.9, min_p_gap=1.0, penalty=1.1, window=64, seed_lo=1, seed_hi=2)
    assert raw.view(np.float32)[0] == 0.5 and raw.view(np.uint32)[1] == 4 and raw.view(np.uint32)[7] == 2


def test_a_uniform_field_the_struct_lacks_or_leaves_out_is_named():
    step = step_struct()
    with pytest.raises(KernelInterfaceError, match=r"Step \(shaders/step.wgsl\).*unknown field\(s\) pos; leaves out "
                                                   r"pos0"):
        step.pack(n_tokens=1, pos=0, out_index=0, attn_splits=1)


def test_binding_by_name_checks_names_count_and_usage(gpu):
    pipe = gpu.pipeline("attn_gate", dict(WG=64, N=64, ROWS_F32=True, ROWS_Q8=False))
    x, gate, y, xq, xm = (gpu.buffer(n, 256) for n in ("x", "gate", "y", "xq", "xm"))
    step = gpu.buffer("step", 16, UNIFORM)
    gpu.bind(pipe, dict(x=x, gate=gate, y=y, step=step, xq=xq, xm=xm), "ok")
    with pytest.raises(KernelInterfaceError, match=r"bad: shaders/attn_gate.wgsl declares bindings x, gate, y, step, "
                                                   r"xq, xm; the host binds unknown name\(s\) out; leaves out y"):
        gpu.bind(pipe, dict(x=x, gate=gate, out=y, step=step, xq=xq, xm=xm), "bad")
    with pytest.raises(KernelInterfaceError, match="declares 6 bindings .* the host gives 3"):
        gpu.bind(pipe, [x, gate, y], "short")
    with pytest.raises(KernelInterfaceError, match=r"binding 'step' is var<uniform>, but the host's buffer 'y' was "
                                                   "not created with UNIFORM usage"):
        gpu.bind(pipe, dict(x=x, gate=gate, y=y, step=y, xq=xq, xm=xm), "usage")
    with pytest.raises(KernelInterfaceError, match=r"binding 'x' is var<storage>, but the host's buffer 'step'"):
        gpu.bind(pipe, dict(x=step, gate=gate, y=y, step=step, xq=xq, xm=xm), "usage")


def test_a_host_expecting_a_write_the_kernel_does_not_do_is_refused():
    wrong = Kernel("attn_gate", writes=("gate",))  # the kernel reads gate: var<storage, read>
    with pytest.raises(KernelInterfaceError, match=r"expects shaders/attn_gate.wgsl to write binding 'gate', which it "
                                                   r"declares as var<storage, read>"):
        assert wrong.bindings
    with pytest.raises(KernelInterfaceError, match=r"to write binding 'out', which it does not declare \(its bindings: "
                                                   "x, gate, y, step, xq, xm\\)"):
        assert Kernel("attn_gate", writes=("out",)).bindings


def test_a_constant_the_kernel_never_uses_is_refused(gpu):
    with pytest.raises(KernelInterfaceError, match="the host sets constant\\(s\\) ROWS that shaders/attn_gate.wgsl "
                                                   "never uses"):
        gpu.pipeline("attn_gate", dict(WG=64, N=64, ROWS=4))


def test_declarations_are_parsed_from_the_source_text():
    k = Kernel("probe", source="""
// a comment naming @group(0) @binding(7) var<storage, read> ghost: array<u32>; is not a binding
struct P { a: u32, b: f32, }
@group(0) @binding(1) var<uniform> p: P;
@group(0) @binding(0) var<storage, read_write> out: array<u32>;
""")
    assert list(k.bindings) == ["out", "p"] and k.bindings["out"].access == "read_write"
    assert k.uniform("p").fields == {"a": (0, np.uint32), "b": (4, np.float32)}
    with pytest.raises(KernelInterfaceError, match="binding indices \\[0, 2\\] are not 0..n-1"):
        Kernel("gap", source="@group(0) @binding(0) var<storage, read> a: array<u32>;\n"
                             "@group(0) @binding(2) var<storage, read> b: array<u32>;")
