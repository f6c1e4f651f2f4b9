#!/usr/bin/env bash
# The writers' ceiling on the device host, no server and no GPU in the way (bench/writer.py), and
# the per-capture cost of turning rows into bytes (bench/serialization.py). Phases:
#   writer         bench/writer.py on the installed wheel: Kimi width (3 aux + final x 7168 bf16),
#                  WriterPool end to end (hand-off, encode, checksum, write, flush, publish)
#   ab             the same, two builds alternating in one run: dist-old/ (the base: `pip wheel --no-deps
#                  -w dist-old` on its checkout) against dist/ (the change), ROUNDS rounds
#   serialization  bench/serialization.py: SGLang's JSON path against the package's, one capture
# Usage (repo root, after `make wheel` here; carry dist, and either .devkit (then `source
# .devkit/env.sh;` first) or .whl with zstandard and xxhash cp312 wheels; ab also carries dist-old):
#   bash bench/writer.sh writer|ab|serialization $OUT [NAME=VALUE ...]
# Knobs (NAME=VALUE arguments or environment): WRITER_FILES (48), WRITER_THREADS (8,16), CODECS
# (zstd+shuffle), DTYPES (model), CHECKSUMS (the package default), DURABILITY (file), GIL_HOG (0),
# WRITER_TIMEOUT (300 per run), ROUNDS (ab: 3), SER_TOKENS (serialization: 512,2048,8192), SER_ARGS (more serialization.py options).
# Every phase also writes $OUT/host.txt (cores, kernel, disk, dirty-page settings).
set -o pipefail
source "$(dirname "${BASH_SOURCE[0]}")/phases.sh"
parse_phase_args "usage: bash bench/writer.sh writer|ab|serialization OUT [NAME=VALUE ...]   (knobs: see the header)" "" "$@"
BASE_PATH=${PYTHONPATH:-}
if ls .whl/*.whl > /dev/null 2>&1; then  # no kit: zstandard and xxhash from carried wheels
  rm -rf /tmp/deps && python -m pip install -q --no-index --no-deps --no-compile --target /tmp/deps .whl/*.whl || exit 1
  BASE_PATH=/tmp/deps${BASE_PATH:+:$BASE_PATH}
  export PYTHONPATH=$BASE_PATH
fi
W=/tmp/writer-work
source bench/device_setup.sh "$OUT"
{ nproc; uname -r; lscpu | grep -E "Model name|Thread|Core|Socket"; free -g | head -2; df -h /tmp | tail -1
  findmnt -T /tmp; for q in rotational write_cache scheduler nr_requests; do echo "$q: $(cat /sys/block/vda/queue/$q 2>/dev/null)"; done
  sysctl vm.dirty_ratio vm.dirty_background_ratio vm.dirty_expire_centisecs; } > "$OUT/host.txt" 2>&1
cd /tmp  # bench/*.py then import the installed wheel, not the tree
writer() {  # writer OUT_STEM: one bench/writer.py run with the knobs
  timeout "${WRITER_TIMEOUT:-300}" python "$R/bench/writer.py" "$1.json" --files "${WRITER_FILES:-48}" \
    --threads "${WRITER_THREADS:-8,16}" --codecs "${CODECS:-zstd+shuffle}" --dtypes "${DTYPES:-model}" \
    ${CHECKSUMS:+--checksums "$CHECKSUMS"} --durability "${DURABILITY:-file}" --gil-hog "${GIL_HOG:-0}" --dir /tmp/wb \
    > "$1.md" 2>> "$OUT/writer.log"
}
rc=0
case $PHASE in
  writer)
    writer "$OUT/writer" || rc=1
    grep -m1 "stage rates" "$OUT/writer.log"; tail -n +3 "$OUT/writer.md"
    ;;
  ab)
    rm -rf /tmp/sc-base
    python -m pip install -q --no-index --no-deps --target /tmp/sc-base "$R"/dist-old/sglang_capture-*.whl || exit 1
    for round in $(seq 1 "${ROUNDS:-3}"); do
      for build in base change; do
        site=/tmp/sc; [ $build = base ] && site=/tmp/sc-base
        PYTHONPATH=$site${BASE_PATH:+:$BASE_PATH} writer "$OUT/writer-$build-$round" || rc=1
        echo "== $build round $round"; tail -n +3 "$OUT/writer-$build-$round.md" | cut -d'|' -f6,8,12,13,17
      done
    done
    ;;
  serialization)
    timeout "${WRITER_TIMEOUT:-300}" python "$R/bench/serialization.py" --tokens "${SER_TOKENS:-512,2048,8192}" ${SER_ARGS:-} \
      --out "$OUT/serialization.json" 2> "$OUT/serialization.log" | tee "$OUT/serialization.md" || rc=1
    ;;
esac
rm -rf /tmp/wb
exit $rc
