#!/usr/bin/env bash
# One device call on one H200: Kimi-K2.5's own class under SGLang's default graph settings (issue 16
# item 2). SGLang 0.5.17 gives KimiK25ForConditionalGeneration tc_piecewise prefill CUDA graphs by
# default, for extend batches of up to 2,048 tokens under MLA; nothing graph-related is passed
# here except the decode graphs' batch size (--cuda-graph-max-bs, decode only, for a short start).
#   make wheel (here); source .devkit/env.sh; bash bench/h200_kimi_graphs.sh $OUT   carry: .devkit, dist
# 1. Exactness: bench/gpu_e2e.py on the test bed's tiny Kimi-K2.5 (4 layers, width 512, GPU MLA
#    head dims) against transformers on its language model, with chunks of 2,560 tokens and a
#    3,000-token prompt (first chunk above the graphs' limit: eager; last below: graph); batches of
#    capture, JSON and plain requests. Beside it, the same check on the tiny DeepSeek-V3 (eager
#    prefill), the TP1 re-run after the test bed's rope change.
# 2. Idle overhead under prefill graphs (the per-batch aux switch does not apply there): bench/e2e.py
#    ab (plain vs launcher idle) and capture_ab on a Kimi-width tiny Kimi-K2.5, chunked prefill at
#    2,048 so that every extend batch runs in a graph; cut at AB_TIMEOUT, partial windows kept.
# Two servers on one GPU under SGLang 0.5.17: the KV budget is what is free at its profiling minus
# (1 - --mem-fraction-static) of what was free before loading, so a neighbour loading in between
# leaves nothing (r36: "Loaded weights leave no GPU memory for the KV cache"). A high fraction
# with --max-total-tokens capping the pool works in any start order.
W=/tmp/kg-work
source bench/device_setup.sh "$@"
cd /tmp
KIMI_ARGS="--trust-remote-code --mm-attention-backend sdpa"
tiny_model /tmp/k512 --arch kimi_k25 --shape gpu --hidden 512 > $W/mk.log 2>&1 || { cat $W/mk.log; exit 1; }
tiny_model /tmp/d512 --arch deepseek_v3 --shape gpu --hidden 512 >> $W/mk.log 2>&1 || { cat $W/mk.log; exit 1; }
tiny_model /tmp/k7168 --arch kimi_k25 --shape gpu --hidden 7168 > $W/mk7168.log 2>&1 &
CAPTURE_DIR=/tmp/capk timeout ${E2E_TIMEOUT:-300} python "$R/bench/gpu_e2e.py" /tmp/k512 $W/kimi --reference /tmp/k512-text \
  --chunk 2560 --long 3000 --server-args "$KIMI_ARGS --mem-fraction-static 0.3" > $W/kimi.txt 2>&1 &
kimi_pid=$!
sleep 20
CAPTURE_DIR=/tmp/capd timeout ${E2E_TIMEOUT:-300} python "$R/bench/gpu_e2e.py" /tmp/d512 $W/dsv3 \
  --server-args "--mem-fraction-static 0.3" > $W/dsv3.txt 2>&1
rc_d=$?
wait $kimi_pid
rc_k=$?
cp $W/kimi/gpu_e2e.json "$OUT/gpu_e2e-kimi.json" 2>/dev/null
cp $W/dsv3/gpu_e2e.json "$OUT/gpu_e2e-dsv3.json" 2>/dev/null
if [ "${SKIP_AB:-0}" != 1 ]; then
  wait
  timeout ${AB_TIMEOUT:-270} python "$R/bench/e2e.py" /tmp/k7168 $W/ab --phases ab,capture_ab --tokens 1024 \
    --concurrency 16 --seconds ${E2E_SECONDS:-10} --ab-rounds ${AB_ROUNDS:-2} --client-procs 2 --capture-dir /tmp/capab \
    --sglang-args "--attention-backend triton --grammar-backend none --sleep-on-idle --cuda-graph-max-bs 64 \
--chunked-prefill-size 2048 --max-running-requests 128 --mem-fraction-static 0.85 --max-total-tokens 200000 $KIMI_ARGS" > $W/ab.md 2> $W/ab.log
  cp $W/ab/e2e.json "$OUT/e2e-kimi-graphs-ab.json" 2>/dev/null
  grep -h -i "piecewise\|breakable\|aux layers" $W/ab/*.log | cut -c1-300 > "$OUT/ab-graph-lines.txt" 2>/dev/null
  cp $W/ab.log "$OUT/ab.log"; tail -8 $W/ab.log
fi
tail -12 $W/kimi.txt; tail -10 $W/dsv3.txt
tar -C $W -czf "$OUT/logs.tgz" --exclude='*.msgpack' --exclude='captures' . 2>/dev/null
[ $rc_k = 0 ] && [ $rc_d = 0 ]
