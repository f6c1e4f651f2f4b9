#!/usr/bin/env bash
# One device call: host and disk facts, the writer's host-side ceiling (bench/writer.py), then the
# end-to-end benchmark (bench/e2e.py) with the writer count that the sweep found fastest.
# Run from the repo root on the GPU machine, with the device kit and the wheel (make wheel; carry .devkit, dist):
#   source .devkit/env.sh; bash bench/h200_throughput.sh $OUT
# Leaves at most 8 files in OUT (the device tool's limit): writer.json, e2e.md, host.txt, logs.tgz and
# e2e/ (e2e.json, rewritten after every window so a call cut short keeps it, and the two server logs).
W=/tmp/bench-work
rm -rf /tmp/caps /tmp/caps-v*  # a warm machine still holds the last call's capture dirs
source bench/device_setup.sh "$@"
{ nproc; uname -r; lscpu | grep -E "Model name|Thread|Core|Socket"; free -g | head -2; df -h /tmp | tail -1
  findmnt -T /tmp; for q in rotational write_cache scheduler nr_requests; do echo "$q: $(cat /sys/block/vda/queue/$q 2>/dev/null)"; done
  sysctl vm.dirty_ratio vm.dirty_background_ratio vm.dirty_expire_centisecs; } > "$OUT/host.txt" 2>&1
cd /tmp
tiny_model /tmp/mk --arch deepseek_v3 --shape gpu --layers 4 --hidden 7168 > $W/mk.log 2>&1 &
MK=$!
python "$R/bench/writer.py" $W/writer.json --codecs ${WRITER_CODECS:-zstd+shuffle,zstd1+shuffle,none} \
  --threads ${WRITER_THREADS:-8,12,16} --durability ${WRITER_DURABILITY:-file,group,none} --files ${WRITER_FILES:-72} \
  --gil-hog 1 --dir /tmp/wb 2> $W/writer.log
cp $W/writer.json "$OUT/"
BEST=$(python -c "import json,sys; r=[x for x in json.load(open(sys.argv[1]))['runs'] if x['codec']==sys.argv[2] and x['durability']==sys.argv[3]]; print(max(r,key=lambda x:x['tok_per_s'])['threads'])" $W/writer.json zstd+shuffle ${E2E_DURABILITY:-file})
echo "writers for e2e: $BEST"
wait $MK
python "$R/bench/e2e.py" /tmp/mk $OUT/e2e --seconds ${E2E_SECONDS:-16} --capture-dir /tmp/caps \
  --capture-args "--capture-layers 1,2,3 --capture-writers $BEST --capture-durability ${E2E_DURABILITY:-file} ${CAPTURE_EXTRA:-}" 2> $W/e2e.log | tee "$OUT/e2e.md"
tail -8 $W/e2e.log
tar -C $W -czf "$OUT/logs.tgz" --exclude='*.msgpack' . 2>/dev/null
