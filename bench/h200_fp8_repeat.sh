#!/usr/bin/env bash
# One device call (issue 28 item 2): FP8 rows that cannot be overwritten on a GPU.
# 1. bench/gpu_fp8_repeat.py race: the pack-on-the-copy-stream hazard in isolation ([16384, 28672]
#    bf16, 10 trials without and with read_on_current_stream) and pack's extra device memory.
# 2. bench/gpu_fp8_repeat.py repeat: a launcher with --capture-dtype fp8 on the Kimi-compute shape
#    (61 layers, width 7168, --load-format dummy, default layers 3/31/59) decoding for 64 plain
#    clients while one fixed 4,096-token prompt is captured 16 times: every repeat must store the
#    first one's bytes.
#   make wheel   (here, then carry ["dist", ".devkit"])
#   source .devkit/env.sh; bash bench/h200_fp8_repeat.sh $OUT
W=/tmp/fp8r-work
rm -rf $W /tmp/kimi
source bench/device_setup.sh "$@"
cd /tmp
python "$R/bench/gpu_fp8_repeat.py" race $OUT > $W/race.txt 2>&1
rc=$?
tail -2 $W/race.txt
tiny_model /tmp/kimi --arch deepseek_v3 --shape kimi --layers ${KIMI_LAYERS:-61} --hidden 7168 \
  --experts ${KIMI_EXPERTS:-8} > $W/mk.log 2>&1 || { cat $W/mk.log; exit 1; }
timeout ${REPEAT_TIMEOUT:-420} python "$R/bench/gpu_fp8_repeat.py" repeat /tmp/kimi $W/repeat --repeats ${REPEATS:-16} \
  --load ${LOAD:-64} --extra-server-args "--load-format dummy" > $W/repeat.txt 2>&1
rc2=$?
cp $W/repeat/gpu_fp8_repeat.json "$OUT/" 2>/dev/null
tail -2 $W/repeat.txt
tar -C $W -czf "$OUT/logs.tgz" --exclude='*.msgpack' . 2>/dev/null
exit $(( rc || rc2 ))
