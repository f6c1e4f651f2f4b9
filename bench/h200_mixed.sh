#!/usr/bin/env bash
# One device call: the mixed load (an open-loop stream of capture requests beside closed-loop
# decode clients) on plain SGLang and on capture servers that differ in one setting each, all up
# at once so the comparison shares the machine's state. Which setting keeps the requests that do
# not capture at plain SGLang's speed?
#   make wheel (here); source .devkit/env.sh; bash bench/h200_mixed.sh $OUT   carry: .devkit, dist
# Variants (';'-separated capture args, each one more server) via MIXED_VARIANTS. Results and
# server logs go to $OUT/e2e (e2e.json rewritten after every window: a call cut short keeps them).
W=/tmp/bench-work
rm -rf /tmp/caps /tmp/caps-v*  # a warm machine still holds the last call's capture dirs
source bench/device_setup.sh "$@"
cd /tmp
lscpu > $W/lscpu.txt 2>&1; cat /sys/devices/system/cpu/cpu0/topology/thread_siblings_list >> $W/lscpu.txt 2>&1
# MODEL_LAYERS: a deeper model makes the GPU, not the scheduler thread, the bottleneck (as for Kimi-K2.5)
tiny_model /tmp/mk --arch deepseek_v3 --shape gpu --layers ${MODEL_LAYERS:-4} --hidden 7168 > $W/mk.log 2>&1
python "$R/bench/e2e.py" /tmp/mk $OUT/e2e --phases ${MIXED_PHASES:-mixed} --seconds ${E2E_SECONDS:-16} --ab-rounds ${AB_ROUNDS:-3} --mixed-rounds ${MIXED_ROUNDS:-1} --client-procs ${CLIENT_PROCS:-4} --profile-steps ${PROFILE_STEPS:-0} --profile-activities ${PROFILE_ACTIVITIES:-GPU} ${IDLE_MIXED:+--idle-mixed} --py-spy-seconds ${PY_SPY_SECONDS:-0} --capture-dir /tmp/caps \
  --capture-args "--capture-layers ${CAPTURE_LAYERS:-1,2,3} --capture-writers ${WRITER_THREADS:-16}" \
  --sglang-args "$SGLANG_GPU_ARGS --mem-fraction-static ${MEM_FRACTION:-0.9}" \
  --variants="${MIXED_VARIANTS:-}" --mixed-rates "${MIXED_RATES:-}" \
  2> $W/e2e.log | tee "$OUT/e2e-mixed.md"
tail -12 $W/e2e.log
# profiler traces (bench/trace_summary.py's summaries are in e2e.json) come back as one archive
[ -d $OUT/e2e/pyspy ] && tar -C $OUT/e2e -czf "$OUT/pyspy.tgz" pyspy && rm -rf $OUT/e2e/pyspy
[ -d $OUT/e2e/profile ] && tar -C $OUT/e2e -czf "$OUT/traces.tgz" profile && rm -rf $OUT/e2e/profile
[ -f "$OUT/traces.tgz" ] && [ $(stat -c%s "$OUT/traces.tgz") -gt 15000000 ] && rm -f "$OUT/traces.tgz"
tar -C $W -czf "$OUT/logs.tgz" --exclude='*.msgpack' . 2>/dev/null
