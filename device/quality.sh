#!/usr/bin/env bash
# Issue 7 on one H200: train a small Qwen3 LM on the offline text of the machine (stdlib and
# site-packages sources), then the KV-cache accuracy table (BF16, naive INT2, KIVI, Hadamard,
# OSCAR per layer / per head, +-Lloyd-Max, +-windows): held-out perplexity and attention error.
#
#   device run, command: bash device/quality.sh [TRAIN_MINUTES] [more scripts/train_small_lm.py args]
#   e.g.  bash device/quality.sh            # 6 min of training, ~8.5 min in all
#         SERVED=1 bash device/quality.sh 4 # then serve the same checkpoint (+~2.5 min;
#                                           # carry .device-bundle/p2 after the p1 staging call)
#         bash device/quality.sh 6 --moe    # the Qwen3-MoE variant
#
# Needs torch, transformers and tokenizers (the device image has them); no network, no install
# (PYTHONPATH points at ./python). The checkpoint goes to $CKPT (default /tmp/oscar_quality/ckpt),
# statistics and fitted rotations to $WORK; results and logs to $OUT: gpu.txt, train.log,
# train_summary.json, train_log.jsonl, preflight.log, quality.log, quality.md, quality.json.
# $QUALITY_ARGS adds arguments to `sglang-oscar quality` (e.g. "--eval-tokens 65536"), $SERVED_ARGS to
# `python -m tests.e2e.served_quality`; $SERVED_ROTATION picks the served rotation (default $WORK/rot_oscar.safetensors,
# e.g. $WORK/rot_oscar_centred.safetensors for the centred per-layer fit). Both take at most --max-seq-per-file (default 1) sequences from each
# held-out / calibration file, round robin over the files in a seeded order; quality.md's header and
# quality.json ("heldout_files", "calib_files") say how many files each set covers.
# First a ~30 s preflight (PREFLIGHT=0 skips it): the same two steps on a tiny model and the
# stdlib's email/json packages, so that a GPU-side problem stops the run before 6 minutes of training.
# STAGE=train stops after training, STAGE=eval skips it (needs a finished $CKPT from a STAGE=train
# call on the same warm machine). TRAIN_MINUTES counts the training loop only; corpus collection,
# the tokenizer and saving add ~1 minute, the preflight ~30 s. So a 600 s device call holds at most
# ~8 minutes of training and nothing else: `STAGE=train PREFLIGHT=0 bash device/quality.sh 8 ...`,
# then at once (the machine goes back 30 s after a call) `STAGE=eval SERVED=1 bash device/quality.sh`.
set -uo pipefail
minutes=6
if [[ "${1:-}" =~ ^[0-9]+([.][0-9]+)?$ ]]; then minutes="$1"; shift; fi
OUT="${OUT:-/tmp/out}"
CKPT="${CKPT:-/tmp/oscar_quality/ckpt}"
WORK="${WORK:-/tmp/oscar_quality/work}"
STAGE="${STAGE:-all}"
case "$CKPT" in ""|/) echo "CKPT must name a checkpoint directory (got '$CKPT')"; exit 2;; esac
case "$STAGE" in all|train|eval) ;; *) echo "STAGE must be all, train or eval (got '$STAGE')"; exit 2;; esac
if [ "$STAGE" = eval ] && [ ! -f "$CKPT/train_summary.json" ]; then
  # train_summary.json is written last: a checkpoint without it is missing or unfinished
  echo "STAGE=eval: no finished checkpoint in $CKPT (no train_summary.json; run STAGE=train on this machine first, or set CKPT)"
  exit 2
fi
mkdir -p "$OUT" "$WORK"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"
python -c "import torch, transformers, tokenizers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'transformers', transformers.__version__, 'tokenizers', tokenizers.__version__)" | tee -a "$OUT/gpu.txt"

DEVICE="${DEVICE:-cuda}"
if [ "${PREFLIGHT:-1}" = 1 ] && [ "$STAGE" != eval ]; then
  stdlib=$(python -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
  pre=/tmp/oscar_quality/preflight
  { python scripts/train_small_lm.py "$@" --out "$pre" --device "$DEVICE" --max-steps 3 --layers 2 --hidden 64 --heads 4 \
      --kv-heads 2 --head-dim 32 --intermediate 128 --experts 4 --moe-intermediate 32 --vocab 384 --seq-len 128 \
      --batch 4 --no-system-text --text-dir "$stdlib/email" --text-dir "$stdlib/json" --heldout-frac 0.2 \
      --max-mb 2 --eval-every 0 --eval-seqs 4 \
    && python -m sglang_oscar.cli quality --model "$pre" --out-dir "$pre/q" --device "$DEVICE" --seq-len 128 --calib-tokens 2048 \
      --eval-tokens 512 --sink 4 --recent 16 --kivi-residual 16 --kivi-group 16 --min-tokens 1000 --no-progress; \
  } > "$OUT/preflight.log" 2>&1
  rc=$?
  if [ "$rc" -ne 0 ]; then tail -40 "$OUT/preflight.log"; echo "preflight failed (rc $rc)"; exit "$rc"; fi
  echo "preflight ok after $(( $(date +%s) - start )) s"
fi

if [ "$STAGE" != eval ]; then
  rm -rf "$CKPT"  # a killed run must not leave an older checkpoint behind for STAGE=eval
  python scripts/train_small_lm.py --out "$CKPT" --minutes "$minutes" --device "$DEVICE" "$@" 2>&1 | tee "$OUT/train.log"
  rc=${PIPESTATUS[0]}
  cp "$CKPT/train_summary.json" "$CKPT/train_log.jsonl" "$OUT/" 2>/dev/null
  if [ "$rc" -ne 0 ]; then echo "training failed (rc $rc)"; exit "$rc"; fi
  echo "training done after $(( $(date +%s) - start )) s"
  if [ "$STAGE" = train ]; then echo "STAGE=train: checkpoint in $CKPT"; exit 0; fi
else
  cp "$CKPT/train_summary.json" "$CKPT/train_log.jsonl" "$OUT/"
  echo "STAGE=eval: using the checkpoint in $CKPT ($(python -c "import json,sys; d=json.load(open(sys.argv[1])); \
print(d['steps'], 'steps,', round(d['total_seconds']), 's of training')" "$CKPT/train_summary.json"))"
fi

# shellcheck disable=SC2086
python -m sglang_oscar.cli quality --model "$CKPT" --out-dir "$OUT" --work-dir "$WORK" --device "$DEVICE" --no-progress \
  ${QUALITY_ARGS:-} 2>&1 | tee "$OUT/quality.log"
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 0 ] && [ "${SERVED:-0}" = 1 ]; then
  # the same checkpoint and fitted per-layer rotation served by SGLang (needs the sglang bundle:
  # carry .device-bundle/p2 or run after an earlier call installed /tmp/site); the table is
  # appended to quality.md (only 8 files come back from $OUT)
  # shellcheck disable=SC1091,SC2086
  rm -rf "$WORK/served"  # no table of an earlier call on this machine
  ( export OUT="$WORK"; source device/env.sh > "$WORK/served_env.log" 2>&1 && \
    python -m tests.e2e.served_quality --model "$CKPT" --out "$WORK/served" --rotation "${SERVED_ROTATION:-$WORK/rot_oscar.safetensors}" \
      ${SERVED_ARGS:-} > "$WORK/served.log" 2>&1 ) ; src=$?
  { echo; echo "## Served (python -m tests.e2e.served_quality, same checkpoint and rotation, rc $src)"; echo;
    cat "$WORK/served/served_quality.md" 2>/dev/null || tail -20 "$WORK/served.log"; } | tee -a "$OUT/quality.md"
  [ "$src" -eq 0 ] || rc=$src
fi
echo "total $(( $(date +%s) - start )) s (rc $rc)" | tee -a "$OUT/quality.log"
exit "$rc"
