# Sourced by the device scripts (bench/h200_*.sh) after `source .devkit/env.sh` (the device kit:
# ../shared/device/README.md): checks OUT, makes the work dir W, puts this clone's package on
# PYTHONPATH and builds models with the package's own test bed (`tiny_model OUT ARGS...`); R is
# the repo root. SGLANG_GPU_ARGS: the server settings every mixed-load run uses (each script adds
# its memory fraction), so that runs of different scripts load the same server.
set -u
OUT=${1:?usage: $0 OUT_DIR}
R=$PWD
mkdir -p "$OUT" "$W"
# `pip install -e .` fails there: setuptools loads every installed egg_info writer, and the kit's
# `kernels` package has a broken one. A copy with the seam tables where setup.cfg maps them works;
# without the entry point, SGLang's spawned processes are patched by the launcher module itself.
rm -rf /tmp/sc && mkdir -p /tmp/sc && cp -r "$R/sglang_capture" /tmp/sc/ && cp -r "$R/patches" /tmp/sc/sglang_capture/patches
export PYTHONPATH=/tmp/sc:${PYTHONPATH:-}
tiny_model() { python -m sglang_capture.testbed.tiny_models "$@"; }
SGLANG_GPU_ARGS="--attention-backend triton --grammar-backend none --sleep-on-idle --max-total-tokens 300000 --cuda-graph-max-bs 64 --chunked-prefill-size 16384 --max-running-requests 128"
