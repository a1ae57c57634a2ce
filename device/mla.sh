#!/usr/bin/env bash
# MLA (DeepSeek-V3 latent cache) device run in one call: GPU tests of the latent path, the served
# check on a tiny DeepSeek-V3 and the latent decode benchmark (repository root, after the staging call).
#   bash device/mla.sh tests check      (one call, ~7 min: the GPU tests and mla_check)
#   bash device/mla.sh bench            (the next call, ~4-5 min; all three steps do not fit one 600 s call)
#   bash device/mla.sh extend           (the served gather extend vs the direct INT2 extend kernel vs BF16)
# Results in $OUT (at most 8 files come back): kernels.log, mla_check.md / .json, latent.md, logs.tgz
# (server logs, pytest logs, the benchmark's stdout). MLA_BUDGET (default 300; a fresh machine's first
# int2 servers JIT-compile for ~3 min: 220 was too short) bounds the check's startup + requests;
# MLA_FAMILY (default deepseek_v3; glm5 / glm5_dense: DSA sparse attention, top-k 256 / 2048, under
# SGLang's dsa backend, needs deep_gemm from .device-bundle/wheels, below; kimi_linear: the latent
# pool in a linear-attention hybrid; minimax_m3 / minimax_m3_dense: MiniMax-M3's sparse layers over the
# INT2 MHA pool, dummy weights; deepseek_v3_expanded: the DeepSeek-V3 model with --oscar-mla-storage
# expanded, per-head K/V in the INT2 MHA pool) its model;
# MLA_SERVERS (default: those of the family's judged items but the opt-in ones) the check's servers, comma-separated: a
# subset, and/or the family's reported servers (glm5*, minimax_m3_dense: int2-window-chunk64;
# minimax_m3: bf16-chunk64), and/or int2-window-hadamard (int2-window under the default Hadamard
# rotation: a default, judged as "rotated", where the family has no oracle, else reported), and/or the
# opt-in plugin-off (judged as "plugin": SGLang without the plugin vs bf16) and int2-eager ("graph": int2
# without CUDA graphs vs int2) and int2-tp2 ("tp": int2 at --tp-size 2 vs int2; a two-GPU kind), and on the
# DeepSeek-V3 families int2-fp32 / bf16-fp32 (--dtype float32 twins: "oracle-fp32", int2-fp32 vs the fp32
# oracle <= 0.02), e.g. MLA_SERVERS=bf16,plugin-off,int2,int2-eager;
# MLA_BATCH_INVARIANT=1: the int2 servers run SGLang's batch-invariant GEMMs (mla_check --batch-invariant);
# BENCH_VARIANTS (default served,bf16:32:4:16:codes,bf16:32: the served tiles, the 16-head ones at every head count,
# the dequantizing engine) the benchmark's columns.
# MLA_CALL_S (default 590): seconds of the device call; the check's timeout is shortened so that its SIGTERM
# still leaves time to stop the servers and copy the results to $OUT before the call ends.
set -u
cd "$(dirname "$0")/.."
R="${OUT:-/tmp/out}"; mkdir -p "$R"
# shellcheck disable=SC1091
export OUT="$R"; source device/env.sh > "$R/env.log" 2>&1 || { tail -20 "$R/env.log"; exit 1; }
# a warm machine keeps /tmp: an earlier call's logs and results must not be returned as this one's
L=/tmp/mla_logs; rm -rf "$L" /tmp/mla /tmp/mla_k; mkdir -p "$L"
# SGLang's DSA indexer (GLM-5) calls deep_gemm at model build; the bundle lacks it: carry
# .device-bundle/wheels with sgl_deep_gemm (pip download --no-deps --only-binary=:all: --python-version 3.12
# -d .device-bundle/wheels sgl-deep-gemm==0.1.4.post1, the version sglang 0.5.16 installs)
if ! python3 -c "import deep_gemm" 2>/dev/null && ls .device-bundle/wheels/sgl_deep_gemm*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index --target /tmp/deep_gemm .device-bundle/wheels/sgl_deep_gemm*.whl \
    > "$R/deep_gemm.log" 2>&1 && export PYTHONPATH="$PYTHONPATH:/tmp/deep_gemm"
fi
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(tests check bench)
rc=0
for step in "${steps[@]}"; do
  case "$step" in
    tests)
      OUT=/tmp/mla_k TESTS_TIMEOUT=150 FILES="test_latent.py tests/plugin/test_latent_backend.py" \
        bash device/kernels.sh tests > "$R/kernels.log" 2>&1 || rc=1
      cp /tmp/mla_k/*.log "$L/" 2>/dev/null ;;
    check)
      # SIGTERM at budget + 60 s, or earlier where setup (a fresh machine's bundle install) or the tests step
      # used the call's time: the check then stops its servers (30 s) and writes; the copy below must still run
      budget=${MLA_BUDGET:-300}; term=$(( budget + 60 )); left=$(( ${MLA_CALL_S:-590} - SECONDS - 55 ))
      if [ "$term" -gt "$left" ]; then term=$left; budget=$(( left - 60 )); fi
      [ "$budget" -ge 60 ] || { echo "check: ${left} s left of the call, too little for the check"; rc=1; continue; }
      timeout -k 45 "$term" python3 -m tests.e2e.mla_check --family "${MLA_FAMILY:-deepseek_v3}" \
        --out /tmp/mla --budget "$budget" ${MLA_SERVERS:+--servers "$MLA_SERVERS"} \
        $([ "${MLA_BATCH_INVARIANT:-0}" = 0 ] || echo --batch-invariant) \
        > "$L/mla_check.log" 2>&1 || rc=1
      cp /tmp/mla/mla_check.md /tmp/mla/mla_check.json "$R/" 2>/dev/null; cp /tmp/mla/*.log "$L/" 2>/dev/null
      [ -f "$R/mla_check.md" ] || tail -20 "$L/mla_check.log" ;;  # it stopped before its table: say why here
    extend)
      timeout 240 python3 -m benchmarks.bench_latent_extend --out "$R/latent_extend.md" > "$L/bench_latent_extend.log" 2>&1 \
        || rc=1 ;;
    bench)
      timeout 300 python3 -m benchmarks.bench_latent --variants "${BENCH_VARIANTS:-served,bf16:32:4:16:codes,bf16:32}" \
        --out "$R/latent.md" > "$L/bench_latent.log" 2>&1 || rc=1 ;;
    *) echo "unknown step $step (tests, check, bench, extend)"; exit 2 ;;
  esac
done
tar czf "$R/logs.tgz" -C "$L" .
tail -3 "$R/kernels.log" 2>/dev/null; cat "$R/mla_check.md" "$R/latent.md" "$R/latent_extend.md" 2>/dev/null
exit $rc
