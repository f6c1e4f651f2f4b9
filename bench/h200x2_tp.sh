#!/usr/bin/env bash
# One device call on nvidia-h200-x2: the capture server's GPU check (bench/gpu_e2e.py) with --tp 1
# and with --tp 2 on the same dense Llama, then the two captures compared
# file by file (bench/compare_captures.py). Issue 5 item 3.
#   make wheel (here); source .devkit/env.sh; bash bench/h200x2_tp.sh $OUT   carry: .devkit, dist
W=/tmp/tp-work
source bench/device_setup.sh "$@"
cd /tmp
tiny_model /tmp/ml --arch llama --layers 4 --hidden 256 > $W/mk.log 2>&1
nvidia-smi -L > "$OUT/gpus.txt"
rc=0
for tp in 1 2; do
  CAPTURE_DIR=/tmp/cap-tp$tp python "$R/bench/gpu_e2e.py" /tmp/ml $W/llama-tp$tp --tp $tp > $W/llama-tp$tp.txt 2>&1 || rc=1
  tail -8 $W/llama-tp$tp.txt
done
python "$R/bench/compare_captures.py" /tmp/cap-tp1 /tmp/cap-tp2 --json "$OUT/compare-llama.json" | tee $W/compare-llama.txt || rc=1
cp $W/llama-tp2/gpu_e2e.json "$OUT/gpu_e2e-llama-tp2.json" 2>/dev/null
cp $W/llama-tp1/gpu_e2e.json "$OUT/gpu_e2e-llama-tp1.json" 2>/dev/null
tar -C $W -czf "$OUT/logs.tgz" --exclude='*.msgpack' . 2>/dev/null
exit $rc
