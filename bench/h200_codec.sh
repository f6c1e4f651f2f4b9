#!/usr/bin/env bash
# One device call without the SGLang kit (issue 18 items 3 and 4): carry `.whl` only (nvCOMP 6.0.0's
# two cu13 wheels and zstandard for Python 3.12, 38 MB; `pip download --no-deps --python-version 3.12
# --only-binary :all: nvidia-nvcomp-cu13 nvidia-libnvcomp-cu13 zstandard -d .whl`).
#   make wheel (here); bash bench/h200_codec.sh $OUT      carry: .whl, dist (the package from its wheel)
# 1. bench/gpu_codec.py: nvCOMP zstd on the GPU against the writers' CPU codec, bf16 and fp8 rows at
#    Kimi width: ratio, GB/s, host cores per GB/s, and whether `zstandard` reads every frame.
# 2. bench/writer.py: the writers' ceiling and host cores per GB/s for bf16 and fp8, 72 files of
#    2,048 tokens per configuration (the 16-file runs of r38 lasted 1-2 s each).
set -u
OUT=${1:?usage: $0 OUT_DIR}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  dist/sglang_capture-*.whl || exit 1
export PYTHONPATH=/tmp/site
timeout ${CODEC_TIMEOUT:-240} python bench/gpu_codec.py --tokens ${CODEC_TOKENS:-8192} --chunk-kb ${CODEC_CHUNKS:-64,256,1024,4096} \
  --out "$OUT/gpu_codec.json" > "$OUT/gpu_codec.md" 2> "$OUT/gpu_codec.log"
rc=$?
tail -12 "$OUT/gpu_codec.md"
timeout ${WRITER_TIMEOUT:-300} python bench/writer.py "$OUT/writer.json" --files ${WRITER_FILES:-72} --threads ${WRITER_THREADS:-8,16} \
  --codecs zstd+shuffle,none --gil-hog 0 --dtypes model,fp8 --dir /tmp/wb > "$OUT/writer.md" 2> "$OUT/writer.log"
rc_w=$?
tail -8 "$OUT/writer.md"
rm -rf /tmp/wb
[ $rc = 0 ] && [ $rc_w = 0 ]
