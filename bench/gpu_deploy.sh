#!/usr/bin/env bash
# Exactness on GPUs and the deployment configurations Kimi-K2.5 is served with. Phases:
#   graphs    one H200: Kimi-K2.5's own class under SGLang's default graph settings (tc_piecewise
#             prefill CUDA graphs for extend batches of up to 2,048 tokens under MLA; only the decode
#             graphs' batch size is passed). 1. bench/gpu_e2e.py on the test bed's tiny Kimi-K2.5 (4
#             layers, width 512, GPU MLA head dims) against transformers on its language model, chunks of
#             2,560 tokens and a 3,000-token prompt (first chunk eager, last in a graph), batches of
#             capture, JSON and plain requests; beside it the same check on the tiny DeepSeek-V3 (eager
#             prefill). 2. Idle overhead under prefill graphs (the per-batch aux switch does not apply
#             there): bench/e2e.py ab and capture_ab on a Kimi-width tiny Kimi-K2.5, chunked prefill at
#             2,048 so every extend batch runs in a graph; cut at AB_TIMEOUT (SKIP_AB=1: part 1 only).
#             CAPTURE_ARGS: more launcher options for part 1 (`--capture-final both
#             --disable-prefill-cuda-graph`: the pre-norm final state checked too, under decode graphs).
#   configs   bench/gpu_deploy.py --configs CONFIGS (default tp1,tp2; also dp2, dp_attn, tp2_nodes) on the
#             test bed's DeepSeek-V3 (width 512, fixed routing), each against --tp 1; nvidia-h200-x2.
#   pd        one H200: bench/gpu_deploy.py --configs tp1,pd, a capture prefill server and a plain decode
#             server sharing the GPU, KV over Mooncake's TCP transport; PD_ARCH=kimi_k25 for the tiny
#             Kimi-K2.5 in its own class (tc_piecewise graphs on its reference server). Carries .whl/
#             mooncake-slim.tar.xz (built here by the pd-kit phase; the whole wheel and the kit do not fit
#             one call's 64 MiB). Where .devkit + .whl + the tree pass 64 MiB, carry .devkit alone in a first
#             call (`source .devkit/env.sh`) and .whl, dist in the next at once: the warm machine keeps .devkit.
#   pd-kit    (here, not on the device) builds .whl/mooncake-slim.tar.xz, about 6.7 MB: Mooncake 0.3.14's
#             CUDA 13 transfer engine cut to what SGLang's PD backend loads (`mooncake.engine`: engine.so,
#             its libasio/etcd wrapper and four bundled libraries), libibverbs/libmlx5 from the pyverbs
#             wheel (vb/), and fallback/: Debian's libnuma.so.1 and a stand-in libcurl.so.4 (engine.so
#             links libcurl for an HTTP metadata server SGLang's P2P handshake never uses; every call of
#             the stand-in fails cleanly). Needs pip, apt-get, gcc, xz.
#   spec      one H200: bench/gpu_spec.py on the test bed's EAGLE-3 pair (a SPEC_LAYERS x SPEC_HIDDEN Llama
#             whose layers add little, 24 x 2048 by default, and its one-layer draft): chain and tree
#             drafting with capture against the same target without speculation, tokens and verify
#             passes unchanged by capture, throughput with every request capturing (SPEC_ARGS: its flags).
#   fp8-rows  one H200: bench/gpu_fp8.py, each of FP8_PROMPTS prompts (up to FP8_TOKENS tokens) captured
#             alone in bf16 and in FP8 on one launcher (4-layer DeepSeek-V3 of width 7168, fixed routing,
#             layers 1,2,3), compared row for row: cosine and relative error per block, bytes per token.
# Usage (repo root, after `make wheel` here; carry .devkit and dist, pd also .whl):
#   source .devkit/env.sh; bash bench/gpu_deploy.sh graphs|configs|pd|spec|fp8-rows $OUT [NAME=VALUE ...]
#   bash bench/gpu_deploy.sh pd-kit
# Knobs (NAME=VALUE arguments or environment): CONFIGS, PD_ARCH, E2E_TIMEOUT, AB_TIMEOUT, E2E_SECONDS,
# AB_ROUNDS, SKIP_AB, DEPLOY_TIMEOUT, SPEC_LAYERS, SPEC_HIDDEN, SPEC_OUT_SCALE, SPEC_ARGS, SPEC_TIMEOUT, FP8_PROMPTS, FP8_TOKENS,
# FP8_TIMEOUT.
# Two servers on one GPU under SGLang 0.5.17 (graphs, pd): the KV budget is what is free at its profiling
# minus (1 - --mem-fraction-static) of what was free before loading, so a neighbour loading in between
# leaves nothing (r36: "Loaded weights leave no GPU memory for the KV cache"); a high fraction with
# --max-total-tokens capping the pool works in any start order.
set -o pipefail
source "$(dirname "${BASH_SOURCE[0]}")/phases.sh"
check_phase "usage: bash bench/gpu_deploy.sh graphs|configs|pd|spec|fp8-rows|pd-kit OUT [NAME=VALUE ...]   (pd-kit: no OUT; knobs: see the header)" "${1:-}"
PHASE=$1
shift

if [ "$PHASE" = pd-kit ]; then
  set -euo pipefail
  OUT_TAR="$PWD/.whl/mooncake-slim.tar.xz"
  T=$(mktemp -d)
  trap 'rm -rf "$T"' EXIT
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$T" mooncake-transfer-engine-cuda13==0.3.14 pyverbs==56.0rc1 2>&1 |
    grep -v "is ignored" || true
  S="$T/slim" L=mooncake_transfer_engine_cuda13.libs
  mkdir -p "$S/mooncake" "$S/$L" "$S/vb" "$S/fallback" "$T/w"
  unzip -q "$T"/mooncake_transfer_engine_cuda13-*.whl -d "$T/w"
  cp "$T"/w/mooncake/{__init__.py,engine.so,libasio.so,libetcd_wrapper.so} "$S/mooncake/"
  cp "$T"/w/$L/{libyaml-cpp,libjsoncpp,libglog,libgflags}-* "$S/$L/"
  strip --strip-unneeded "$S"/mooncake/libetcd_wrapper.so "$S"/mooncake/libasio.so "$S"/$L/libyaml-cpp-*
  unzip -q -j "$T"/pyverbs-*.whl 'pyverbs.libs/libibverbs-*' 'pyverbs.libs/libmlx5-*' 'pyverbs.libs/libnl-*' -d "$S/vb"
  (cd "$S/vb" && ln -s libibverbs-*.so.* libibverbs.so.1 && ln -s libmlx5-*.so.* libmlx5.so.1)
  (cd "$T" && apt-get download -q libnuma1 >/dev/null 2>&1 && dpkg -x libnuma1_*.deb deb)
  cp -L "$T"/deb/usr/lib/x86_64-linux-gnu/libnuma.so.1 "$S/fallback/"
  cat > "$T/curl.c" <<'C'
#include <stddef.h>
void *curl_easy_init(void) { return NULL; }
int curl_global_init(long flags) { (void)flags; return 0; }
void curl_easy_cleanup(void *h) { (void)h; }
char *curl_easy_escape(void *h, const char *s, int n) { (void)h; (void)s; (void)n; return NULL; }
int curl_easy_getinfo(void *h, int info, ...) { (void)h; (void)info; return 2; }
int curl_easy_perform(void *h) { (void)h; return 2; }
void curl_easy_reset(void *h) { (void)h; }
int curl_easy_setopt(void *h, int opt, ...) { (void)h; (void)opt; return 2; }
const char *curl_easy_strerror(int code) { (void)code; return "libcurl stand-in: not available"; }
void curl_free(void *p) { (void)p; }
void *curl_slist_append(void *l, const char *s) { (void)s; return l; }
void curl_slist_free_all(void *l) { (void)l; }
C
  gcc -shared -fPIC -O2 -Wl,-soname,libcurl.so.4 -o "$S/fallback/libcurl.so.4" "$T/curl.c"
  # every library engine.so needs resolves from here, but CUDA's (the device has those)
  missing=$(LD_LIBRARY_PATH="$S/vb:$S/fallback" ldd "$S/mooncake/engine.so" | grep "not found" | grep -v -e libcuda -e libcudart || true)
  [ -z "$missing" ] || { echo "unresolved: $missing"; exit 1; }
  mkdir -p "$(dirname "$OUT_TAR")"
  tar -C "$S" -cf - . | xz -T0 -9 > "$OUT_TAR"
  ls -l "$OUT_TAR"
  exit 0
fi

out_and_knobs "$@"  # pd-kit, above, takes neither
W=/tmp/deploy-$PHASE
rm -rf "$W"  # a warm machine still holds the last call's captures
source bench/device_setup.sh "$OUT"

graph_lines() {  # which prefill batches ran in a CUDA graph, per server log
  for f in "$@"; do
    echo "$(basename "$f"): $(grep -c 'Prefill batch' "$f") prefill batches, $(grep 'Prefill batch' "$f" | grep -c 'cuda graph: True') in a graph"
    grep -h -E "CUDA graph for|incompatible with|Disable prefill CUDA graph|sglang_capture: aux" "$f" | cut -c23-260 | sort -u
  done
}

case $PHASE in
  graphs)
    cd /tmp
    KIMI_ARGS="--trust-remote-code --mm-attention-backend sdpa"
    tiny_model /tmp/k512 --arch kimi_k25 --shape gpu --hidden 512 > $W/mk.log 2>&1 || { cat $W/mk.log; exit 1; }
    tiny_model /tmp/d512 --arch deepseek_v3 --shape gpu --hidden 512 >> $W/mk.log 2>&1 || { cat $W/mk.log; exit 1; }
    tiny_model /tmp/k7168 --arch kimi_k25 --shape gpu --hidden 7168 > $W/mk7168.log 2>&1 &
    CAPTURE_DIR=/tmp/capk timeout "${E2E_TIMEOUT:-300}" python "$R/bench/gpu_e2e.py" /tmp/k512 $W/kimi --reference /tmp/k512-text \
      --chunk 2560 --long 3000 --server-args "$KIMI_ARGS --mem-fraction-static 0.3 ${CAPTURE_ARGS:-}" > $W/kimi.txt 2>&1 &
    kimi_pid=$!
    sleep 20
    CAPTURE_DIR=/tmp/capd timeout "${E2E_TIMEOUT:-300}" python "$R/bench/gpu_e2e.py" /tmp/d512 $W/dsv3 \
      --server-args "--mem-fraction-static 0.3 ${CAPTURE_ARGS:-}" > $W/dsv3.txt 2>&1
    rc_d=$?
    wait $kimi_pid
    rc_k=$?
    cp $W/kimi/gpu_e2e.json "$OUT/gpu_e2e-kimi.json" 2>/dev/null
    cp $W/dsv3/gpu_e2e.json "$OUT/gpu_e2e-dsv3.json" 2>/dev/null
    if [ "${SKIP_AB:-0}" != 1 ]; then
      wait
      timeout "${AB_TIMEOUT:-270}" python "$R/bench/e2e.py" /tmp/k7168 $W/ab --phases ab,capture_ab --tokens 1024 \
        --concurrency 16 --seconds "${E2E_SECONDS:-10}" --ab-rounds "${AB_ROUNDS:-2}" --client-procs 2 --capture-dir /tmp/capab \
        --sglang-args "--attention-backend triton --grammar-backend none --sleep-on-idle --cuda-graph-max-bs 64 \
--chunked-prefill-size 2048 --max-running-requests 128 --mem-fraction-static 0.85 --max-total-tokens 200000 $KIMI_ARGS" > $W/ab.md 2> $W/ab.log
      cp $W/ab/e2e.json "$OUT/e2e-kimi-graphs-ab.json" 2>/dev/null
      grep -h -i "piecewise\|breakable\|aux layers" $W/ab/*.log | cut -c1-300 > "$OUT/ab-graph-lines.txt" 2>/dev/null
      cp $W/ab.log "$OUT/ab.log"; tail -8 $W/ab.log
    fi
    tail -12 $W/kimi.txt; tail -10 $W/dsv3.txt
    [ $rc_k = 0 ] && [ $rc_d = 0 ]
    rc=$?
    ;;
  configs)
    cd /tmp
    tiny_model /tmp/m --arch deepseek_v3 --shape gpu --hidden 512 > $W/mk.log 2>&1 || { cat $W/mk.log; exit 1; }
    nvidia-smi -L > "$OUT/gpus.txt"
    timeout "${DEPLOY_TIMEOUT:-560}" python "$R/bench/gpu_deploy.py" /tmp/m $W/deploy --captures /tmp/caps \
      --configs "${CONFIGS:-tp1,tp2}" 2>&1 | tee $W/deploy.txt
    rc=${PIPESTATUS[0]}
    cp $W/deploy/gpu_deploy.json "$OUT/gpu_deploy.json" 2>/dev/null
    ;;
  pd)
    MC=/tmp/mooncake
    rm -rf $MC && mkdir -p $MC/use && tar -C $MC -xJf "$R/.whl/mooncake-slim.tar.xz" || exit 1
    for lib in libnuma.so.1 libcurl.so.4; do
      ldconfig -p | grep -q "$lib " || { cp $MC/fallback/$lib $MC/use/; echo "no $lib on the host: using the kit's"; }
    done | tee "$OUT/libs.txt"
    CUDART=$(find $(python -c 'import site; print(" ".join(site.getsitepackages()))') /usr/local/cuda*/lib64 \
      -name 'libcudart.so.13*' 2>/dev/null | head -1)
    export PYTHONPATH=$MC:$PYTHONPATH LD_LIBRARY_PATH=$MC/vb:$MC/use:$(dirname "${CUDART:-/x/x}"):${LD_LIBRARY_PATH:-}
    python -c "import mooncake.engine as e; print('mooncake.engine', e.TransferEngine)" 2>&1 | tee -a "$OUT/libs.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || exit 1
    cd /tmp
    ARCH=${PD_ARCH:-deepseek_v3}
    EXTRA=""
    [ "$ARCH" = kimi_k25 ] && EXTRA="--trust-remote-code --mm-attention-backend sdpa"
    tiny_model /tmp/m --arch "$ARCH" --shape gpu --hidden 512 > $W/mk.log 2>&1 || { cat $W/mk.log; exit 1; }
    nvidia-smi -L > "$OUT/gpus.txt"
    timeout "${DEPLOY_TIMEOUT:-480}" python "$R/bench/gpu_deploy.py" /tmp/m $W/deploy --captures /tmp/caps --configs tp1,pd \
      --server-args "$EXTRA" 2>&1 | tee $W/deploy.txt
    rc=${PIPESTATUS[0]}
    graph_lines $W/deploy/*.log > "$OUT/graphs.txt"
    cp $W/deploy/gpu_deploy.json "$OUT/gpu_deploy-pd-$ARCH.json" 2>/dev/null
    ;;
  spec)
    cd /tmp
    tiny_model /tmp/e3 --arch llama_eagle3 --layers "${SPEC_LAYERS:-24}" --hidden "${SPEC_HIDDEN:-2048}" \
      --out-scale "${SPEC_OUT_SCALE:-0.001}" > $W/mk.log 2>&1 ||
      { cat $W/mk.log; exit 1; }
    nvidia-smi -L > "$OUT/gpus.txt"
    eagle_deep_gemm
    timeout "${SPEC_TIMEOUT:-540}" python "$R/bench/gpu_spec.py" /tmp/e3 $W/spec ${SPEC_ARGS:-} 2>&1 | tee "$OUT/spec.txt"
    rc=${PIPESTATUS[0]}
    cp $W/spec/gpu_spec.json "$OUT/" 2>/dev/null
    ;;
  fp8-rows)
    cd /tmp
    tiny_model /tmp/mk --arch deepseek_v3 --shape gpu --layers 4 --hidden 7168 > $W/mk.log 2>&1 || { cat $W/mk.log; exit 1; }
    timeout "${FP8_TIMEOUT:-420}" python "$R/bench/gpu_fp8.py" /tmp/mk $W/fp8 --prompts "${FP8_PROMPTS:-12}" \
      --max-tokens "${FP8_TOKENS:-4096}" > $W/fp8.txt 2>&1
    rc=$?
    cp $W/fp8/gpu_fp8.json "$OUT/" 2>/dev/null
    tail -12 $W/fp8.txt
    ;;
esac
tar -C $W -czf "$OUT/logs.tgz" --exclude='*.msgpack' --exclude='captures' . 2>/dev/null
exit "$rc"
