#!/usr/bin/env bash
# Device calls for the kernel work of issue 3 (no sglang needed): GPU kernel tests, the
# tuning/splits sweep, the served step per layer (bench_step.py) and ncu issue-stall metrics of the
# default decode kernel at 128K x batch 1. Rotation kernels alone: TESTS_K=rotate ... tests step.
#   bash scripts/device_kernels.sh [tests|tunings|matrix|sweep|step|profile|ncu ...]   (default: tests sweep, <= 530 s;
#                                                   results in $OUT)
#   bash scripts/device_kernels.sh tunings matrix          (a second call, <= 560 s; ncu alone in a third, ~10-150 s)
# ncu: NCU_TUNING (JSON), NCU_TAG (file name), NCU_SASS=1 (per-instruction csv), NCU_WAVES / NCU_CONTEXT /
#      NCU_BATCH / NCU_POOL (sweep_decode.py --pool-layout)
set -u
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD/python" PYTHONUNBUFFERED=1
steps="${*:-tests sweep}"
grid='[{}, {"engine": "gluon", "block_n": 16}, {"async_stages": 3}, {"engine": "triton"}, {"engine": "triton", "num_stages": 1}]'
grid="${SWEEP_GRID:-$grid}"
tuning="${NCU_TUNING:-}"; [ -n "$tuning" ] || tuning='{}'
for s in $steps; do
  case "$s" in
    tests)  # -v: one line per test as it ends, so a timeout still says which passed / failed
      timeout "${TESTS_TIMEOUT:-330}" python -m pytest -v -rf --tb=short -m gpu tests/kernels \
        -k "${TESTS_K:-(decode or extend or write) and not every_tuning}" \
        -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1; echo "gpu tests rc=$?"
      grep -E "(FAILED|ERROR)( |$)" "$OUT/gpu_tests.log" | head -20; tail -1 "$OUT/gpu_tests.log";;
    tunings)  # test_gpu_decode_every_tuning: ~90-100 s per parameter set (21 tunings to compile)
      timeout 300 python -m pytest -v -rf --tb=short -m gpu tests/kernels -k every_tuning -p no:cacheprovider \
        > "$OUT/gpu_tunings.log" 2>&1; echo "gpu tuning tests rc=$?"
      grep -E "(PASSED|FAILED|ERROR)( |$)" "$OUT/gpu_tunings.log" | sed 's/.*:://' | head; tail -1 "$OUT/gpu_tunings.log";;
    matrix)  # decode correctness per head_dim x tuning, vs the oracle (~3 min)
      timeout 260 python scripts/decode_matrix.py --json "$OUT/matrix.json" > "$OUT/matrix.txt" 2>&1
      echo "decode matrix rc=$?"; grep -E "BAD|ERROR|cases" "$OUT/matrix.txt" | head -20;;
    sweep)
      timeout 200 python scripts/sweep_decode.py --contexts "${SWEEP_CONTEXTS:-4096,32768,131072}" \
        --batches "${SWEEP_BATCHES:-1,8,32}" --waves "${SWEEP_WAVES:-8,32}" \
        --grid "$grid" \
        --out "$OUT/sweep.md" --json "$OUT/sweep.json" > "$OUT/sweep.log" 2>&1; echo "sweep rc=$?";;
    step)  # one layer's served decode step: rotations (torch / triton / triton-qkv, output slices), write,
           # attention, whole step vs BF16's copy + SDPA (scripts/bench_step.py)
      timeout 300 python scripts/bench_step.py --contexts "${STEP_CONTEXTS:-32768,131072}" --batches "${STEP_BATCHES:-1,32}" \
        --rotate-block-n "${STEP_BLOCK_N:-16,32,64}" --out "$OUT/step.md" > "$OUT/step.log" 2>&1
      echo "step rc=$?"; cat "$OUT/step.md";;
    profile)  # device time per kernel of a decode call (stage 1, merge) vs the whole call (~40 s)
      timeout 120 python scripts/profile_decode.py --contexts 4096,32768,131072 --batches 1,8,32 \
        --out "$OUT/profile.md" > "$OUT/profile.log" 2>&1; echo "profile rc=$?"; cat "$OUT/profile.md";;
    ncu)  # NCU_TAG names the files; with NCU_SASS=1 also the per-SASS-instruction stall samples (csv)
      tag="${NCU_TAG:-ncu}"
      timeout 150 ncu --clock-control none -k regex:_decode_stage1 -s 5 -c 1 \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
        --section WarpStateStats --section SourceCounters \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sector_op_read_hit_rate.pct,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sector_pipe_lsu_mem_global_op_ld_hit_rate.pct,smsp__inst_executed.sum" \
        --import-source no -f -o "/tmp/$tag" \
        python scripts/sweep_decode.py --profile "$tuning" --waves "${NCU_WAVES:-12}" \
        --contexts "${NCU_CONTEXT:-131072}" --batches "${NCU_BATCH:-1}" --pool-layout "${NCU_POOL:-random}" > "$OUT/$tag.txt" 2>&1; echo "ncu rc=$?"
      ncu -i "/tmp/$tag.ncu-rep" >> "$OUT/$tag.txt" 2>&1
      [ "${NCU_SASS:-0}" = 1 ] && ncu -i "/tmp/$tag.ncu-rep" --page source --print-source sass --csv \
        > "$OUT/${tag}_sass.csv" 2>&1; true;;
  esac
done
