#!/usr/bin/env bash
# The decode variants' A/B in one job (BENCH.md, session 8): their kernel tests on this GPU, each kernel's cost in
# Phi-3's decode chain under each variant, and engine bench with old and new alternating. Run from the project root
# on the GPU machine once its environment is prepared (../shared/gpu-notes.md); results go under $OUT (default /tmp).
set -u
out=${OUT:-/tmp}
python3 -m pytest -q -p no:cacheprovider -n 12 tests/test_kernels_attention_decode.py tests/test_kernels_q8_norm.py \
  -m "not slow" 2>&1 | tail -4
python3 bench/chain_profile.py phi3-mini --tokens 10 --options '{"decode_attention": "serial"}' \
  --options '{"decode_attention": "batched"}' --options '{"decode_attention": "lanes"}' \
  --options '{"norm_matvec_splits": null}' --json "$out/chain.json" 2>&1 | grep -E "decode token|attention_decode|matvec_q8_norm"
i=0
for s in phi3-mini qwen3-4b; do
  for o in '{}' '{"decode_attention": "lanes"}' '{}' '{"decode_attention": "lanes"}'; do  # session 10: the rest lost
    i=$((i + 1))
    python3 -m engine bench --shape "$s" --runs 2 --long-prompt-tokens 0 --timestamps --options "$o" > "$out/bench_$i.txt" 2>&1
    echo "$s $o: $(grep -E "decode_tok_s|gpu_ms_per_token" "$out/bench_$i.txt" | tr -s ' ' | tr '\n' ' ')"
  done
done
python3 bench/driver_memory_probe.py smollm2-135m-demo --pipelines 60 --bind-groups 2000 --json "$out/probe.json"
