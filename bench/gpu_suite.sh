#!/usr/bin/env bash
# The GPU host session behind bench/RESULTS.md: the GPU test suite and the benchmarks, logs in
# $OUT (or ./gpu-out). Run from the repository root on an H100/H200 with the wheels from
# ../shared/gpu/bundle-wheels.sh (plus httpx2, httpcore2, truststore for openai 3.x) in .whl/.
#   bash bench/gpu_suite.sh [tests|bench|all]   (default all)
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
what=${1:-all}
ckpt=/tmp/v2lite
if [ "$what" != tests ] && [ ! -f $ckpt/config.json ]; then
    python3 bench/make_checkpoint.py --out $ckpt >"$out/make_checkpoint.log" 2>&1 &
    writer=$!
fi
if [ "$what" != bench ]; then
    timeout "${TEST_TIMEOUT:-480}" python3 -m pytest -m gpu -q -p no:cacheprovider -s -rs \
        >"$out/gpu_suite.log" 2>&1
    grep -E "passed|failed|^FAILED|^ERROR|agreement|graph vs eager|graph pool" "$out/gpu_suite.log"
fi
[ "$what" = tests ] && exit 0
[ -n "${writer:-}" ] && wait "$writer"
tail -1 "$out/make_checkpoint.log"
# bf16 and its FP8 block-quantized twin (issue 9), in one run: per-model tables, then the ratio.
python3 tools/fp8_checkpoint.py $ckpt $ckpt-fp8 --device cuda >"$out/fp8_checkpoint.log" 2>&1
timeout 330 python3 bench/decode.py --model $ckpt $ckpt-fp8 --rounds 2 >"$out/decode_v2lite.log" 2>&1
grep -A10 -E "^device:|vs /tmp" "$out/decode_v2lite.log"
timeout 60 python3 bench/decode.py --contexts 1024 --rounds 2 >"$out/decode_default.log" 2>&1
tail -6 "$out/decode_default.log" | head -5
timeout 95 python3 bench/serve_tpot.py --rounds 3 >"$out/serve_tpot.log" 2>&1
tail -6 "$out/serve_tpot.log" | head -5
timeout 200 python3 bench/prefill.py --model $ckpt --rounds 1 >"$out/prefill.log" 2>&1
tail -12 "$out/prefill.log" | head -11
timeout 150 python3 bench/moe_prefill.py --glue >"$out/moe_prefill.log" 2>&1
grep -v '^{' "$out/moe_prefill.log"
timeout 240 python3 bench/spec.py --rounds 1 --new-tokens 48 >"$out/spec.log" 2>&1
tail -20 "$out/spec.log" | head -19
