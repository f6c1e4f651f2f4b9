#!/usr/bin/env bash
# One device call (issue 18 item 2): FP8 storage on a served random-weight checkpoint at Kimi width.
# bench/gpu_fp8.py captures each of 12 prompts (up to 4,096 tokens) alone in bf16 and in FP8 on one
# launcher (4-layer DeepSeek-V3 of width 7168 from the test bed, fixed routing, layers 1,2,3) and
# compares them row for row: cosine and relative error per block, bytes per token on disk.
#   make wheel (here); source .devkit/env.sh; bash bench/h200_fp8_rows.sh $OUT   carry: .devkit, dist
W=/tmp/fp8-work
rm -rf $W  # a warm machine still holds the last call's captures
source bench/device_setup.sh "$@"
cd /tmp
tiny_model /tmp/mk --arch deepseek_v3 --shape gpu --layers 4 --hidden 7168 > $W/mk.log 2>&1 || { cat $W/mk.log; exit 1; }
timeout ${FP8_TIMEOUT:-420} python "$R/bench/gpu_fp8.py" /tmp/mk $W/fp8 --prompts ${FP8_PROMPTS:-12} \
  --max-tokens ${FP8_TOKENS:-4096} > $W/fp8.txt 2>&1
rc=$?
cp $W/fp8/gpu_fp8.json "$OUT/" 2>/dev/null
tail -12 $W/fp8.txt
tar -C $W -czf "$OUT/logs.tgz" --exclude='*.msgpack' . 2>/dev/null
exit $rc
