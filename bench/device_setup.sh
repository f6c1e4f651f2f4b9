# Sourced by the device scripts (bench/h200_*.sh): checks OUT, makes the work dir W, installs the
# package wheel carried in .whl/ and puts it on PYTHONPATH; R is the repo root.
set -u
OUT=${1:?usage: $0 OUT_DIR}
R=$PWD
mkdir -p "$OUT" "$W"
pip install -q --no-deps --no-index --target /tmp/sc .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/sc:${PYTHONPATH:-}
