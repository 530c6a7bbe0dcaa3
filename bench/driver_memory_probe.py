"""GPU memory the driver takes for objects that are not buffers (pipelines, bind groups), measured with NVML, and
how many of them a model's load makes.

bench/load_peak.py measures a load against memfit's plan of its buffers; what is left over on a small model (the demo)
is the driver's own: each compute pipeline's code and each bind group's descriptors live in device memory too. This
probe opens a device, then creates `--pipelines` distinct pipelines of a one-line kernel and `--bind-groups` bind
groups, reading the used memory (engine-free NVML, as load_peak) after each step; then in a fresh device it loads
each `shapes` argument as load_peak does, counting the pipelines and bind groups the load created. NVIDIA only.

    python3 bench/driver_memory_probe.py [smollm2-135m-demo phi3-mini ...] [--pipelines 200] [--bind-groups 4000]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.load_peak import UsedMemory  # noqa: E402

KERNEL = """
@group(0) @binding(0) var<storage, read_write> a: array<u32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) i: vec3<u32>) {{ a[i.x] = a[i.x] * {k}u + 1u; }}
"""

# A kernel whose private array is indexed at run time, so it lives in the driver's per-thread local memory: if the
# driver sizes that memory for every thread the GPU can hold, the pipeline alone grows used memory by ~that × 2 KiB.
PRIVATE_KERNEL = """
@group(0) @binding(0) var<storage, read_write> a: array<u32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) i: vec3<u32>) {
    var t: array<u32, 512>;
    for (var k = 0u; k < 512u; k++) { t[k] = a[(i.x + k) % 64u]; }
    a[i.x] = t[a[i.x] % 512u];
}
"""


def settled(used: UsedMemory, gpu) -> int:
    gpu.sync()
    time.sleep(0.3)
    return used()


def objects(n_pipelines: int, n_groups: int) -> dict:
    import numpy as np

    from engine.gpu import Gpu

    used, gpu = UsedMemory(), Gpu()
    base = settled(used, gpu)
    pipes = [gpu.pipeline_from_source(f"probe{k}", KERNEL.format(k=k + 3)) for k in range(n_pipelines)]
    after_pipes = settled(used, gpu)
    buf = gpu.upload("probe", np.zeros(64, np.uint32))
    groups = [gpu.bind(pipes[0], [buf], f"g{k}") for k in range(n_groups)]
    after_groups = settled(used, gpu)
    gpu.pipeline_from_source("probe_private", PRIVATE_KERNEL)
    after_private = settled(used, gpu)
    return {"pipelines": n_pipelines, "pipeline_bytes_each": (after_pipes - base) / max(1, n_pipelines),
            "bind_groups": len(groups), "bind_group_bytes_each": (after_groups - after_pipes) / max(1, len(groups)),
            "pipelines_mb": round((after_pipes - base) / 1e6, 2),
            "bind_groups_mb": round((after_groups - after_pipes) / 1e6, 2),
            "private_2kib_pipeline_mb": round((after_private - after_groups) / 1e6, 2)}


def counted_load(shape: str) -> dict:
    from bench import load_peak
    from engine.gpu import Gpu

    counts = {"bind": 0}
    real_bind = Gpu.bind

    def bind(self, *a, **k):
        counts["bind"] += 1
        return real_bind(self, *a, **k)

    Gpu.bind = bind
    made = []
    real_init = Gpu.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        made.append(self)

    Gpu.__init__ = init
    used, grown = UsedMemory(), {}
    real_pipeline = Gpu.pipeline

    def pipeline(self, shader, consts=None):  # the used memory before and after each new pipeline
        n = len(self._pipelines)
        self.sync()  # pending uploads land first, so only the pipeline's own memory counts below
        before = used()
        built = real_pipeline(self, shader, consts)
        if len(self._pipelines) > n:
            time.sleep(0.02)
            name = getattr(shader, "name", shader)
            grown[name] = grown.get(name, 0) + used() - before
        return built

    Gpu.pipeline = pipeline
    out = load_peak.one(shape, None, None, None)
    out["pipelines_built"] = len(made[0]._pipelines) if made else None
    out["bind_groups_made"] = counts["bind"]
    out["pipeline_growth_mb"] = round(sum(grown.values()) / 1e6, 2)
    out["pipeline_growth_by_kernel_mb"] = {k: round(v / 1e6, 2) for k, v in sorted(grown.items(), key=lambda kv: -kv[1])
                                           if v}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shapes", nargs="*", default=[])
    ap.add_argument("--pipelines", type=int, default=200)
    ap.add_argument("--bind-groups", type=int, default=4000)
    ap.add_argument("--json")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child process: one shape's counted load
    args = ap.parse_args()
    if args.one:
        print(json.dumps(counted_load(args.one)))
        return
    import subprocess

    rows = [{"probe": "objects", **objects(args.pipelines, args.bind_groups)}]
    print(json.dumps(rows[0]), flush=True)
    for shape in args.shapes:  # each in a fresh process, as load_peak runs them
        out = subprocess.run([sys.executable, __file__, "--one", shape], capture_output=True, text=True, timeout=900)
        line = (out.stdout.strip().splitlines() or [out.stderr.strip()[-400:]])[-1]
        print(line, flush=True)
        try:
            rows.append(json.loads(line))
        except ValueError:
            rows.append({"shape": shape, "error": line})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
