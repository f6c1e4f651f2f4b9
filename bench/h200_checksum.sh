#!/usr/bin/env bash
# Issue 28 item 9 on the H200 host (16 cores): the writers' ceiling with each file checksum, in one
# run (bench/writer.py: Kimi width, the default codec, 8 and 16 writer processes, sha256 against
# xxh3_128, no server and no GPU in the way).
#   here: make wheel;  carry [".devkit", "dist"]:  source .devkit/env.sh; bash bench/h200_checksum.sh $OUT
set -u
OUT=${1:?usage: $0 OUT_DIR}
W=/tmp/ck
source bench/device_setup.sh "$OUT"
cd /tmp  # bench/writer.py then imports the installed wheel, not the tree
timeout ${WRITER_TIMEOUT:-200} python "$R/bench/writer.py" "$OUT/writer-checksum.json" --files ${WRITER_FILES:-48} \
  --threads ${WRITER_THREADS:-8,16} --codecs zstd+shuffle --gil-hog 0 --checksums sha256,xxh3_128 --dir /tmp/wb \
  > "$OUT/writer-checksum.md" 2> "$OUT/writer-checksum.log"
rc=$?
grep -m1 "stage rates" "$OUT/writer-checksum.log"
tail -6 "$OUT/writer-checksum.md"
rm -rf /tmp/wb
exit $rc
