#!/usr/bin/env bash
# GPU kernel tests (one pytest call per test file) and the kernel benchmarks on the GPU machine.
#   bash device/kernels.sh [STEP ...] [FILE.py ...]          (repository root; results and logs in $OUT)
# Steps (default: tests):
#   tests    python -m pytest -q -m gpu tests/kernels/<file>, one call per file (log $OUT/gpu_<file>.log);
#            the files: the FILE.py arguments, else $FILES (a name is taken in tests/kernels/, a path from
#            the repository root, e.g. tests/plugin/test_backend.py), else every tests/kernels/test_*.py. The whole
#            suite needs more than one 600 s device call: split it, e.g.
#              bash device/kernels.sh tests test_decode.py test_decode_gpu.py     # call 1
#              FILES="test_write.py test_extend.py" bash device/kernels.sh tests bench   # call 2
#            TESTS_K is the -k filter (default "not every_triton_config": that test is the configs step; TESTS_K=""
#            runs everything); TESTS_TIMEOUT (default 300) bounds each file.
#   suite    every GPU test of tests/kernels and tests/plugin in one pytest call spread over GPU_WORKERS
#            (default 6) pytest-xdist workers sharing the GPU: the Triton compiles, not the GPU, bound the
#            suite's time (log $OUT/gpu_suite.log; SUITE_TIMEOUT, default 480 s). pytest-xdist comes from
#            .device-bundle/wheels/*.whl when the machine lacks it (carry that folder; fill it here with
#            pip download --no-deps --only-binary=:all: --python-version 3.12 -d .device-bundle/wheels
#            pytest-xdist execnet). 112 tests took 141 s over 8 workers on one H200 (0da0f9c: 111 passed).
#   bench    python -m benchmarks.bench_decode --no-sweep --pool-layout served ($OUT/bench_decode.md, .json)
#   configs  the every-Triton-config decode test (-k every_triton_config, ~90-100 s per parameter set)
#   matrix   decode correctness per head_dim x config vs the oracle (tests/kernels/decode_matrix.py, ~3 min)
#   xmatrix  extend correctness per head_dim x group x operand dtype x tile vs the oracle (tests/kernels/extend_matrix.py)
#   sweep    configs x split counts (benchmarks.sweep_decode; SWEEP_CONTEXTS, SWEEP_BATCHES, SWEEP_WAVES, SWEEP_GRID)
#   step     one layer's served decode step (benchmarks.bench_step; STEP_CONTEXTS, STEP_BATCHES, STEP_BLOCK_N)
#   extend   one layer's served prefill step, INT2 pieces vs SGLang's BF16 extend (benchmarks.bench_extend_step;
#            EXTEND_CONFIGS: JSON list of extend-kernel config changes, one attention column each)
#   layer    one layer's decode step with per-kernel times (benchmarks.bench_layer_step --profile; LAYERS, default
#            gemma4-sliding,gemma4-full; dsv3-expanded = DeepSeek-V3 stored as expanded MHA, K 192 / V 128;
#            LAYER_VARIANTS, default served: also fold-out, fold, bk16, one row each)
#   profile  device time per kernel of a decode call (benchmarks.profile_decode, ~40 s)
#   ncu      issue-stall metrics of the decode kernel (NCU_CONFIG JSON, NCU_TAG file name, NCU_SASS=1
#            per-instruction csv, NCU_WAVES / NCU_CONTEXT / NCU_BATCH / NCU_POOL)
# The sglang bundle is only set up (device/env.sh) when it was carried or is installed already: the
# kernels need torch and triton alone. Exit code: 1 if a test file or a step failed.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
if [ -f .device-bundle/p2/install.sh ] || [ -d /tmp/site/sglang ]; then
  # shellcheck disable=SC1091
  source device/env.sh || exit 1
else
  export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
fi
steps=(); files=()
for a in "$@"; do
  case "$a" in */*.py) files+=("$a");; *.py) files+=("tests/kernels/$a");; *) steps+=("$a");; esac
done
[ ${#steps[@]} -gt 0 ] || steps=(tests)
if [ ${#files[@]} -eq 0 ]; then
  if [ -n "${FILES:-}" ]; then
    for f in $FILES; do case "$f" in */*) files+=("$f");; *) files+=("tests/kernels/$f");; esac; done
  else
    files=(tests/kernels/test_*.py)
  fi
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"
grid='[null, {"engine": "gluon", "block_n": 16}, "triton", {"engine": "triton", "num_stages": 1, "defer_sums": false}]'
grid="${SWEEP_GRID:-$grid}"
ncu_config="${NCU_CONFIG:-}"; [ -n "$ncu_config" ] || ncu_config='null'
rc=0
for s in "${steps[@]}"; do
  case "$s" in
    tests)
      for f in "${files[@]}"; do
        [ -f "$f" ] || { echo "no such test file: $f"; rc=1; continue; }
        name="${f##*/}"; log="$OUT/gpu_${name%.py}.log"
        k=(); [ -n "${TESTS_K-not every_triton_config}" ] && k=(-k "${TESTS_K-not every_triton_config}")
        # -rf: the failures' names at the end; a timeout still leaves the passed dots in the log
        timeout "${TESTS_TIMEOUT:-300}" python -m pytest -q -rf --tb=short -m gpu "$f" "${k[@]}" \
          -p no:cacheprovider > "$log" 2>&1
        frc=$?
        # 5: nothing collected (a file without GPU tests, or -k matched none of its tests)
        if [ "$frc" -ne 0 ] && [ "$frc" -ne 5 ]; then rc=1; fi
        echo "$f: rc=$frc: $(tail -1 "$log")"
        grep -E "^(FAILED|ERROR) " "$log" | head -20
      done;;
    suite)
      if ! python -c "import xdist" 2>/dev/null; then
        python -m pip install -q --no-deps --no-index --target /tmp/xdist .device-bundle/wheels/*.whl > "$OUT/xdist.log" 2>&1
        export PYTHONPATH="$PYTHONPATH:/tmp/xdist"
      fi
      timeout "${SUITE_TIMEOUT:-480}" python -m pytest -q -rf --tb=short -m gpu tests/kernels tests/plugin \
        -n "${GPU_WORKERS:-6}" -k "${TESTS_K-not every_triton_config}" -p no:cacheprovider > "$OUT/gpu_suite.log" 2>&1
      src=$?; [ "$src" -eq 0 ] || rc=1
      echo "suite rc=$src: $(tail -1 "$OUT/gpu_suite.log")"; grep -E "^(FAILED|ERROR) " "$OUT/gpu_suite.log" | head -30;;
    bench)
      python -m benchmarks.bench_decode --no-sweep --pool-layout served --out "$OUT/bench_decode.md" \
        --json "$OUT/bench_decode.json" > "$OUT/bench_decode.log" 2>&1; brc=$?
      [ "$brc" -eq 0 ] || rc=1
      echo "bench rc=$brc"; tail -40 "$OUT/bench_decode.log";;
    configs)
      timeout 300 python -m pytest -v -rf --tb=short -m gpu tests/kernels -k every_triton_config -p no:cacheprovider \
        > "$OUT/gpu_configs.log" 2>&1 || rc=1
      grep -E "(PASSED|FAILED|ERROR)( |$)" "$OUT/gpu_configs.log" | sed 's/.*:://' | head; tail -1 "$OUT/gpu_configs.log";;
    matrix)
      timeout 260 python tests/kernels/decode_matrix.py --json "$OUT/matrix.json" > "$OUT/matrix.txt" 2>&1 || rc=1
      grep -E "BAD|ERROR|cases" "$OUT/matrix.txt" | head -20;;
    xmatrix)
      timeout 260 python tests/kernels/extend_matrix.py > "$OUT/extend_matrix.txt" 2>&1 || { rc=1; tail -3 "$OUT/extend_matrix.txt"; }
      grep -E "^(BAD|ERR) | bad$" "$OUT/extend_matrix.txt" | head -20;;
    sweep)
      timeout 200 python -m benchmarks.sweep_decode --contexts "${SWEEP_CONTEXTS:-4096,32768,131072}" \
        --batches "${SWEEP_BATCHES:-1,8,32}" --waves "${SWEEP_WAVES:-8,32}" --grid "$grid" \
        --out "$OUT/sweep.md" --json "$OUT/sweep.json" > "$OUT/sweep.log" 2>&1 || rc=1
      tail -3 "$OUT/sweep.log";;
    step)
      timeout 300 python -m benchmarks.bench_step --contexts "${STEP_CONTEXTS:-32768,131072}" \
        --batches "${STEP_BATCHES:-1,32}" --rotate-block-n "${STEP_BLOCK_N:-16,32,64}" --out "$OUT/step.md" \
        > "$OUT/step.log" 2>&1 || rc=1
      cat "$OUT/step.md" 2>/dev/null || tail -20 "$OUT/step.log";;
    extend)
      timeout 300 python -m benchmarks.bench_extend_step --configs "${EXTEND_CONFIGS:-[]}" --out "$OUT/extend_step.md" \
        > "$OUT/extend_step.log" 2>&1 || rc=1
      cat "$OUT/extend_step.md" 2>/dev/null || tail -20 "$OUT/extend_step.log";;
    layer)
      timeout 240 python -m benchmarks.bench_layer_step --profile --layers "${LAYERS:-gemma4-sliding,gemma4-full}" \
        --variants "${LAYER_VARIANTS:-served}" \
        --out "$OUT/layer_step.md" > "$OUT/layer_step.log" 2>&1 || rc=1
      grep -E "^\||INT2" "$OUT/layer_step.log" | tail -40;;
    profile)
      timeout 120 python -m benchmarks.profile_decode --contexts 4096,32768,131072 --batches 1,8,32 \
        --out "$OUT/profile.md" > "$OUT/profile.log" 2>&1 || rc=1
      cat "$OUT/profile.md" 2>/dev/null || tail -20 "$OUT/profile.log";;
    ncu)
      tag="${NCU_TAG:-ncu}"
      timeout 150 ncu --clock-control none -k regex:_decode_stage1 -s 5 -c 1 \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
        --section WarpStateStats --section SourceCounters \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sector_op_read_hit_rate.pct,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sector_pipe_lsu_mem_global_op_ld_hit_rate.pct,smsp__inst_executed.sum" \
        --import-source no -f -o "/tmp/$tag" \
        python -m benchmarks.sweep_decode --profile "$ncu_config" --waves "${NCU_WAVES:-12}" \
        --contexts "${NCU_CONTEXT:-131072}" --batches "${NCU_BATCH:-1}" --pool-layout "${NCU_POOL:-random}" \
        > "$OUT/$tag.txt" 2>&1 || rc=1
      ncu -i "/tmp/$tag.ncu-rep" >> "$OUT/$tag.txt" 2>&1
      if [ "${NCU_SASS:-0}" = 1 ]; then
        ncu -i "/tmp/$tag.ncu-rep" --page source --print-source sass --csv > "$OUT/${tag}_sass.csv" 2>&1
      fi;;
    *) echo "unknown step '$s' (tests, suite, bench, configs, matrix, xmatrix, sweep, step, extend, layer, profile, ncu)"; rc=2;;
  esac
done
exit $rc
