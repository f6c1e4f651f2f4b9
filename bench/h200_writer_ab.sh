#!/usr/bin/env bash
# The writers' ceiling of two builds side by side on the H200 host, alternating in one run
# (bench/writer.py: Kimi width, the default codec, 8 and 16 writer processes, each durability):
# dist-old/ (the base) against dist/ (the change). No server and no GPU in the way.
#   here: make wheel; pip wheel --no-deps BASE_TREE -w dist-old; download zstandard and xxhash cp312 wheels into .whl
#   carry [".whl", "dist", "dist-old"]:  bash bench/h200_writer_ab.sh $OUT
set -u
OUT=${1:?usage: $0 OUT_DIR}
R=$PWD
mkdir -p "$OUT"
rm -rf /tmp/deps /tmp/sc-base /tmp/sc-change
python -m pip install -q --no-index --no-deps --target /tmp/deps "$R"/.whl/*.whl || exit 1
python -m pip install -q --no-index --no-deps --target /tmp/sc-base "$R"/dist-old/sglang_capture-*.whl || exit 1
python -m pip install -q --no-index --no-deps --target /tmp/sc-change "$R"/dist/sglang_capture-*.whl || exit 1
cd /tmp  # bench/writer.py then imports the installed wheel, not the tree
rc=0
for round in $(seq 1 "${ROUNDS:-3}"); do
  for build in base change; do
    PYTHONPATH=/tmp/sc-$build:/tmp/deps timeout "${WRITER_TIMEOUT:-300}" python "$R/bench/writer.py" \
      "$OUT/writer-$build-$round.json" --files "${WRITER_FILES:-48}" --threads "${WRITER_THREADS:-8,16}" \
      --codecs zstd+shuffle --gil-hog 0 --durability "${DURABILITY:-file,none}" --dir /tmp/wb \
      > "$OUT/writer-$build-$round.md" 2>> "$OUT/writer-ab.log" || rc=1
    echo "== $build round $round"; tail -n +3 "$OUT/writer-$build-$round.md" | cut -d'|' -f6,8,12,13,17
  done
done
rm -rf /tmp/wb
exit $rc
