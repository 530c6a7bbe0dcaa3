#!/usr/bin/env bash
# Make .peer/llama.cpp-<commit>.tar.xz: the llama.cpp copy vendored in llama-cpp-python 0.3.36 (commit 0c1e57098),
# minus models/docs/tests/examples so it fits a device run's carry limit. The benchmark machine has no network.
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
grep -qx "/.peer/" .git/info/exclude 2>/dev/null || echo "/.peer/" >> .git/info/exclude
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$tmp"
tar xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp"
src="$tmp/llama_cpp_python-0.3.36/vendor/llama.cpp"
rm -rf "$src"/{models,docs,media,tests,examples,benches,.github}
mkdir -p .peer
tar cJf .peer/llama.cpp-0c1e57098.tar.xz -C "$(dirname "$src")" llama.cpp
rm -rf "$tmp"
ls -la .peer
