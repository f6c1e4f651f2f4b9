# Sourced by the device entry points (bench/e2e.sh, writer.sh, gpu_deploy.sh, drafter.sh, vs_specforge.sh)
# after `source .devkit/env.sh` (the device kit: ../shared/device/README.md), as `source
# bench/device_setup.sh OUT` with W (the work dir) set: checks OUT, makes W, installs the package from
# its wheel, puts it on PYTHONPATH and builds models with the package's own test bed (`tiny_model OUT
# ARGS...`); R is the repo root. SGLANG_GPU_ARGS: the server settings every mixed-load run uses (each
# phase adds its memory fraction), so that runs of different phases load the same server.
set -u
OUT=${1:?usage: $0 OUT_DIR}
R=$PWD
mkdir -p "$OUT" "$W"
# The package as users install it: the wheel built here by `make wheel` (into dist/, carried with
# the call: carry ["dist", ...]), installed into /tmp/sc with its entry points (SGLang's plugin).
whl=$(ls "$R"/dist/sglang_capture-*.whl 2>/dev/null | tail -1)
[ -n "$whl" ] || { echo "no dist/sglang_capture-*.whl: run 'make wheel' here and carry dist"; exit 1; }
# Reinstalled only when the wheel changed: servers left running by an earlier call of a chain import from /tmp/sc.
if ! cmp -s "$whl" /tmp/sc/.installed.whl; then
  rm -rf /tmp/sc && python -m pip install -q --no-deps --no-index --no-compile --target /tmp/sc "$whl" && \
    cp "$whl" /tmp/sc/.installed.whl || exit 1
fi
export PYTHONPATH=/tmp/sc:${PYTHONPATH:-}
tiny_model() { python -m sglang_capture.testbed.tiny_models "$@"; }
# SGLang 0.5.17's EAGLE worker imports the DSA attention backend (and with it deep_gemm) only to
# list graph-capable backends; a bf16 Llama never calls it. The kit lacks deep_gemm: use a carried
# sgl-deep-gemm when it imports here, else an empty stand-in, with its JIT off either way.
eagle_deep_gemm() {
  if ! timeout 45 python -c "import deep_gemm" > $W/deep_gemm.txt 2>&1; then
    mkdir -p /tmp/dgstub/deep_gemm && echo '"""Stand-in for the import in dsa_backend."""' > /tmp/dgstub/deep_gemm/__init__.py
    export PYTHONPATH=/tmp/dgstub:$PYTHONPATH
    echo "deep_gemm: empty stand-in (sgl-deep-gemm: $(tail -1 $W/deep_gemm.txt))"
  else echo "deep_gemm: sgl-deep-gemm imports"; fi
  export SGLANG_ENABLE_JIT_DEEPGEMM=false
}
SGLANG_GPU_ARGS="--attention-backend triton --grammar-backend none --sleep-on-idle --max-total-tokens 300000 --cuda-graph-max-bs 64 --chunked-prefill-size 16384 --max-running-requests 128"
