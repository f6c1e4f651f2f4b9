#!/usr/bin/env bash
# One device call: what capture costs a Kimi-class server (issue 18 item 1). The test bed writes a
# config with Kimi-K2.5's per-token compute (61 layers, width 7168, 64 MLA heads, q_lora 1536,
# dense layer 0 of 18,432, routed experts of 2,048 with all 8 active plus 1 shared), served with
# --load-format dummy (random weights, no checkpoint) and the launcher's default layers (3, 31, 59).
# Two servers side by side (plain SGLang and the launcher), each in its half of the GPU, measured
# in alternating windows by bench/e2e.py: plain vs launcher idle (ab), capture-all vs nothing
# capturing on the launcher (capture_ab), and decode clients beside a capture stream vs beside the
# same stream not capturing (mixed with --idle-mixed).
#   make wheel (here); source .devkit/env.sh; bash bench/h200_kimi.sh $OUT   carry: .devkit, dist
# Knobs: KIMI_LAYERS, KIMI_EXPERTS, KIMI_HIDDEN (a smaller model for a dry run), MEM_FRACTION,
# PHASES (prefix_ab adds shared-prefix windows: what a radix-cache hit does), E2E_SECONDS, AB_ROUNDS,
# MIXED_ROUNDS, MIXED_RATES, CONCURRENCY, CAPTURE_ARGS, SGLANG_EXTRA (e.g. --disable-radix-cache),
# REQUEST_VARIANTS (issue 18: '{"capture_dtype": "fp8"}' adds FP8 windows on the same server), and
# PARALLEL for several GPUs (issue 19 on nvidia-h200-x8: PARALLEL="--tp 8" or "--tp 8 --dp 8
# --enable-dp-attention", KIMI_EXPERTS as many as fit: 64 make about 355 GB of bf16 per server, half of 8 H200).
# Two servers of ~57 GiB of weights each on one GPU: SGLang 0.5.17 counts a neighbour's allocation
# against the KV budget (see bench/h200_kimi_graphs.sh), so a high --mem-fraction-static with
# --max-total-tokens (MAX_TOKENS) capping the pool, not half the GPU each.
# The shape serves at --tp 2 on the CPU test bed (4 layers, width 512, dummy weights); not yet on GPUs.
W=/tmp/kimi-work
rm -rf /tmp/caps /tmp/caps-v*
source bench/device_setup.sh "$@"
cd /tmp
tiny_model /tmp/kimi --arch deepseek_v3 --shape kimi --layers ${KIMI_LAYERS:-61} --hidden ${KIMI_HIDDEN:-7168} \
  --experts ${KIMI_EXPERTS:-8} > $W/mk.log 2>&1 || { cat $W/mk.log; exit 1; }
timeout ${E2E_TIMEOUT:-560} python "$R/bench/e2e.py" /tmp/kimi $OUT/e2e --phases ${PHASES:-ab,capture_ab,mixed} --tokens 2048 \
  --concurrency ${CONCURRENCY:-16} --seconds ${E2E_SECONDS:-20} --ab-rounds ${AB_ROUNDS:-3} \
  --mixed-rounds ${MIXED_ROUNDS:-2} --idle-mixed --client-procs 2 --capture-rate ${MIXED_RATES:-1} \
  --mixed-rates ${MIXED_RATES:-1} --capture-dir /tmp/caps --capture-args "${CAPTURE_ARGS:-}" \
  --sglang-args "$SGLANG_GPU_ARGS ${PARALLEL:-} --load-format dummy --chunked-prefill-size 8192 --max-total-tokens ${MAX_TOKENS:-40000} --mem-fraction-static ${MEM_FRACTION:-0.88} ${SGLANG_EXTRA:-}" \
  --variants="${MIXED_VARIANTS:-}" --request-variants="${REQUEST_VARIANTS:-}" 2> $W/e2e.log | tee "$OUT/e2e-kimi.md"
rc=${PIPESTATUS[0]}
tail -12 $W/e2e.log
tar -C $W -czf "$OUT/logs.tgz" --exclude='*.msgpack' . 2>/dev/null
exit $rc
