#!/usr/bin/env bash
# What capture costs a server (bench/e2e.py), one device call per phase on one H200:
#   kimi   a Kimi-class server (issue 18 item 1): the test bed's config with Kimi-K2.5's per-token
#          compute (61 layers, width 7168, 64 MLA heads, q_lora 1536, dense layer 0 of 18,432, routed
#          experts of 2,048 with all 8 active + 1 shared), --load-format dummy, the launcher's default
#          layers (3, 31, 59). Plain SGLang and the launcher side by side on the GPU, in alternating
#          windows: plain vs launcher idle (ab), capture-all vs nothing capturing (capture_ab), a shared
#          prefix vs the usual prompts (prefix_ab), decode clients beside a capture stream (mixed,
#          --idle-mixed).
#   mixed  the mixed load on a 4-layer Kimi-width DeepSeek-V3 (the GPU mostly idle: the writers'
#          ceiling and the scheduler thread's cost): an open-loop capture stream beside closed-loop
#          decode clients, plain SGLang against capture servers differing in one setting each.
#   sessions  multi-turn chat traffic (issue 50, bench/gpu_sessions.py) on a Llama-3.1-8B shape (dummy
#          weights, no tokenizer: ids in, ids out): 64 chats x 8 turns, a shared 1,024-token system prompt,
#          128-token user turns, 64-token answers, each turn re-sending its history; two launchers on the
#          GPU, prefix sharing on and off, each capturing every request against capturing none in
#          alternating windows; then the shared files' rows against private captures of the same tokens.
# Usage (repo root, after `make wheel` here; carry .devkit, dist):
#   source .devkit/env.sh; bash bench/e2e.sh kimi|mixed|sessions $OUT [NAME=VALUE ...]
# NAME=VALUE arguments set the knobs below (the same names work as environment variables).
#   both:  E2E_PHASES (kimi: ab,capture_ab,mixed; mixed: mixed; also prefix_ab, capacity, open, json),
#          E2E_SECONDS, AB_ROUNDS, MIXED_ROUNDS, MIXED_RATES, MIXED_VARIANTS (';'-separated capture
#          args, one more server each), MEM_FRACTION, E2E_TIMEOUT
#   kimi:  KIMI_LAYERS, KIMI_EXPERTS, KIMI_HIDDEN (smaller for a dry run), CONCURRENCY, CAPTURE_ARGS,
#          MAX_TOKENS, SGLANG_EXTRA (e.g. --disable-radix-cache), REQUEST_VARIANTS ('{"capture_dtype":
#          "fp8"}' adds FP8 windows on the same server), PARALLEL (several GPUs: "--tp 8" or "--tp 8 --dp 8
#          --enable-dp-attention" on nvidia-h200-x8, KIMI_EXPERTS as many as fit: 64 make ~355 GB per server)
#   mixed: MODEL_LAYERS, CAPTURE_LAYERS, WRITER_THREADS, CLIENT_PROCS, IDLE_MIXED=1, PY_SPY_SECONDS
#   sessions: SESSIONS_ARGS (gpu_sessions.py's own flags: --sessions, --turns, --rounds, --servers ...),
#          SESSIONS_KV (KV tokens per server, default 240000)
# Two servers of ~57 GiB each on one GPU (kimi): SGLang 0.5.17 counts a neighbour's allocation against
# the KV budget, so a high --mem-fraction-static with --max-total-tokens capping the pool, not half each.
# Results: $OUT/e2e (e2e.json rewritten after every window: a call cut short keeps them), logs.tgz.
set -o pipefail
source "$(dirname "${BASH_SOURCE[0]}")/phases.sh"
parse_phase_args "usage: bash bench/e2e.sh kimi|mixed|sessions OUT [NAME=VALUE ...]   (phases: kimi, mixed, sessions; knobs: see the header)" "" "$@"
rm -rf /tmp/caps /tmp/caps-v*  # a warm machine still holds the last call's capture dirs
W=/tmp/e2e-$PHASE
source bench/device_setup.sh "$OUT"
cd /tmp  # the installed wheel, not the tree
case $PHASE in
  kimi)
    tiny_model /tmp/kimi --arch deepseek_v3 --shape kimi --layers "${KIMI_LAYERS:-61}" --hidden "${KIMI_HIDDEN:-7168}" \
      --experts "${KIMI_EXPERTS:-8}" > $W/mk.log 2>&1 || { cat $W/mk.log; exit 1; }
    timeout "${E2E_TIMEOUT:-560}" python "$R/bench/e2e.py" /tmp/kimi "$OUT/e2e" --phases "${E2E_PHASES:-ab,capture_ab,mixed}" \
      --tokens 2048 --concurrency "${CONCURRENCY:-16}" --seconds "${E2E_SECONDS:-20}" --ab-rounds "${AB_ROUNDS:-3}" \
      --mixed-rounds "${MIXED_ROUNDS:-2}" --idle-mixed --client-procs 2 --capture-rate "${MIXED_RATES:-1}" \
      --mixed-rates "${MIXED_RATES:-1}" --capture-dir /tmp/caps --capture-args "${CAPTURE_ARGS:-}" \
      --sglang-args "$SGLANG_GPU_ARGS ${PARALLEL:-} --load-format dummy --chunked-prefill-size 8192 --max-total-tokens ${MAX_TOKENS:-40000} --mem-fraction-static ${MEM_FRACTION:-0.88} ${SGLANG_EXTRA:-}" \
      --variants="${MIXED_VARIANTS:-}" --request-variants="${REQUEST_VARIANTS:-}" 2> $W/e2e.log | tee "$OUT/e2e-kimi.md"
    rc=${PIPESTATUS[0]}
    ;;
  mixed)
    lscpu > $W/lscpu.txt 2>&1; cat /sys/devices/system/cpu/cpu0/topology/thread_siblings_list >> $W/lscpu.txt 2>&1
    # MODEL_LAYERS: a deeper model makes the GPU, not the scheduler thread, the bottleneck (as for Kimi-K2.5)
    tiny_model /tmp/mk --arch deepseek_v3 --shape gpu --layers "${MODEL_LAYERS:-4}" --hidden 7168 > $W/mk.log 2>&1 || { cat $W/mk.log; exit 1; }
    timeout "${E2E_TIMEOUT:-580}" python "$R/bench/e2e.py" /tmp/mk "$OUT/e2e" --phases "${E2E_PHASES:-mixed}" \
      --seconds "${E2E_SECONDS:-16}" --ab-rounds "${AB_ROUNDS:-3}" --mixed-rounds "${MIXED_ROUNDS:-1}" \
      --client-procs "${CLIENT_PROCS:-4}" ${IDLE_MIXED:+--idle-mixed} --py-spy-seconds "${PY_SPY_SECONDS:-0}" --capture-dir /tmp/caps \
      --capture-args "--capture-layers ${CAPTURE_LAYERS:-1,2,3} --capture-writers ${WRITER_THREADS:-16}" \
      --sglang-args "$SGLANG_GPU_ARGS --mem-fraction-static ${MEM_FRACTION:-0.9}" \
      --variants="${MIXED_VARIANTS:-}" --mixed-rates "${MIXED_RATES:-}" 2> $W/e2e.log | tee "$OUT/e2e-mixed.md"
    rc=${PIPESTATUS[0]}
    # py-spy samples come back as one archive (their summaries are in e2e.json)
    [ -d "$OUT/e2e/pyspy" ] && tar -C "$OUT/e2e" -czf "$OUT/pyspy.tgz" pyspy && rm -rf "$OUT/e2e/pyspy"
    ;;
  sessions)
    python -c "import json, os, sys; sys.path.insert(0, '$R/bench'); from vs_specforge import L8B; \
os.makedirs('/tmp/l8b', exist_ok=True); json.dump(L8B, open('/tmp/l8b/config.json', 'w'))"
    # two 8B servers on one GPU: a high static fraction, each pool capped by --max-total-tokens (see above)
    timeout "${E2E_TIMEOUT:-580}" python "$R/bench/gpu_sessions.py" /tmp/l8b "$OUT/sessions" --caps /tmp/caps \
      --sglang-args "$SGLANG_GPU_ARGS --load-format dummy --skip-tokenizer-init --mem-fraction-static 0.88 \
--max-total-tokens ${SESSIONS_KV:-240000}" ${SESSIONS_ARGS:-} 2> >(tee $W/e2e.log >&2) | tee "$OUT/sessions.md"
    rc=${PIPESTATUS[0]}
    [ -d "$OUT/sessions/pyspy" ] && tar -C "$OUT/sessions" -czf "$OUT/pyspy.tgz" pyspy && rm -rf "$OUT/sessions/pyspy"
    ;;
esac
tail -12 $W/e2e.log
tar -C $W -czf "$OUT/logs.tgz" --exclude='*.msgpack' . 2>/dev/null
exit "$rc"
