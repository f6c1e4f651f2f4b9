# Sourced by the device scripts (bench/h200_*.sh): checks OUT, makes the work dir W, installs the
# package wheel carried in .whl/ and puts it on PYTHONPATH; R is the repo root. SGLANG_GPU_ARGS:
# the server settings every mixed-load run uses (each script adds its memory fraction), so that
# runs of different scripts load the same server.
set -u
OUT=${1:?usage: $0 OUT_DIR}
R=$PWD
mkdir -p "$OUT" "$W"
pip install -q --no-deps --no-index --target /tmp/sc .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/sc:${PYTHONPATH:-}
SGLANG_GPU_ARGS="--attention-backend triton --grammar-backend none --sleep-on-idle --max-total-tokens 300000 --cuda-graph-max-bs 64 --chunked-prefill-size 16384 --max-running-requests 128"
