#!/usr/bin/env bash
# One device call: plain SGLang under the mixed load while background processes spin, stream
# memory, or encode captures like the writers (bench/interference.py says why).
#   make wheel (here); source .devkit/env.sh; bash bench/h200_interference.sh $OUT   carry: .devkit, dist
W=/tmp/bench-work
source bench/device_setup.sh "$@"
cd /tmp
tiny_model /tmp/mk --arch deepseek_v3 --shape gpu --layers ${MODEL_LAYERS:-4} --hidden 7168 > $W/mk.log 2>&1
python "$R/bench/interference.py" /tmp/mk $OUT/interference --procs ${LOAD_PROCS:-5} --rounds ${ROUNDS:-2} --seconds ${SECONDS_PER_WINDOW:-8} \
  --sglang-args "$SGLANG_GPU_ARGS --mem-fraction-static ${MEM_FRACTION:-0.4}" \
  2> $W/interference.log | tee "$OUT/interference.md"
tail -20 $W/interference.log
