#!/usr/bin/env bash
# One device call on one H200: capture on a PD prefill server (issue 16 item 3 on a GPU).
# bench/gpu_deploy.py --configs tp1,pd on the test bed's DeepSeek-V3 (GPU MLA head dims, fixed
# routing): the TP1 capture server is the reference; then a capture prefill server and a plain
# decode server share the GPU, the KV cache going over Mooncake's TCP transport (see gpu_deploy.py).
# PD_ARCH=kimi_k25: the test bed's tiny Kimi-K2.5 (its own class) instead, under SGLang's default
# graph settings, which give its prefill server tc_piecewise prefill CUDA graphs.
#   make wheel; source .devkit/env.sh; [PD_ARCH=kimi_k25] bash bench/h200_pd.sh $OUT   carry: .devkit, .whl, dist
# .whl/mooncake-slim.tar.xz: Mooncake's CUDA 13 transfer engine cut to what `mooncake.engine`
# loads (engine.so and its libraries), pyverbs' libibverbs/libmlx5 as vb/, and fallback/: Debian's
# libnuma.so.1 and a stand-in libcurl.so.4 (engine.so links libcurl for an HTTP metadata server
# that SGLang's P2P handshake never uses), each used only where the host has none. The whole wheel
# (50 MB) and the kit (57 MB) do not fit one call's 64 MiB.
W=/tmp/pd-work
source bench/device_setup.sh "$@"
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
tiny_model /tmp/m --arch $ARCH --shape gpu --hidden 512 > $W/mk.log 2>&1 || { cat $W/mk.log; exit 1; }
nvidia-smi -L > "$OUT/gpus.txt"
timeout ${PD_TIMEOUT:-480} python "$R/bench/gpu_deploy.py" /tmp/m $W/deploy --captures /tmp/caps --configs tp1,pd \
  --server-args "$EXTRA" 2>&1 | tee $W/deploy.txt
rc=${PIPESTATUS[0]}
for f in $W/deploy/*.log; do  # which prefill batches ran in a CUDA graph, per server
  echo "$(basename $f): $(grep -c 'Prefill batch' $f) prefill batches, $(grep 'Prefill batch' $f | grep -c 'cuda graph: True') in a graph"
  grep -h -E "CUDA graph for|incompatible with|Disable prefill CUDA graph|sglang_capture: aux" $f | cut -c23-260 | sort -u
done > "$OUT/graphs.txt"
cp $W/deploy/gpu_deploy.json "$OUT/gpu_deploy-pd-$ARCH.json" 2>/dev/null
tar -C $W -czf "$OUT/logs.tgz" --exclude='*.msgpack' . 2>/dev/null
exit $rc
