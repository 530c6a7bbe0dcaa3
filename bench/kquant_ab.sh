#!/usr/bin/env bash
# The K-quant A/B in one job (issue 19, BENCH.md session 9): the int8 rows in element order (q8_natural) and the
# kernel choice by matrix size, on this GPU's clock. Their tests first, then every K-quant int8 decode kernel and plan
# against Q4_0 (bench/kquant_probe.py), then the catalog's Q4_K_M builds end to end with q8_natural on and off
# (bench/gguf_decode_ab.py, stand-in files written under .cache/). Run from the project root on the GPU machine once
# its environment is prepared (../shared/gpu-notes.md); results go under $OUT (default /tmp). About 8 minutes.
set -u
out=${OUT:-/tmp}
python3 -m pytest -q -p no:cacheprovider -n 12 tests/test_q8_natural.py tests/test_kernels_kquant.py \
  tests/test_kernels_norm_rows.py -m "not slow" 2>&1 | tail -4
python3 bench/kquant_probe.py --types q4_0,q2_k,q3_k,q4_k,q5_k,q6_k,q5_0,q5_1 --kinds "matvec int8" --variants \
  --variant-keys rows,vec4,wide,natural --weight-mib 256 --rounds 7 --json "$out/kquant.json" 2>&1 | tail -60
python3 bench/gguf_decode_ab.py --options '{}' --options '{"q8_natural": false}' --rounds 2 \
  --json "$out/gguf_ab.json" 2>&1 | tail -8
