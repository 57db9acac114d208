#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py) in three commands of at most 9 minutes each:
#
#   benchmarks/gpu_run.sh first DIR     # stages eager, probes, then moe (at most 525 s)
#   benchmarks/gpu_run.sh second DIR    # stage compile (at most 475 s)
#   benchmarks/gpu_run.sh third DIR     # stages fp8, then zb (at most 410 s)
#   benchmarks/gpu_run.sh eager|compile|probes|moe|fp8|zb DIR    # one stage
#
# Options after DIR go to every stage's gpu_check.py (e.g. --device cpu --quick: a dry run on a
# CPU). Each stage runs with its budget (BUDGET, seconds) and is killed GRACE_S seconds after it
# (then 10 s later with SIGKILL); its report DIR/gpu_check_STAGE.json keeps what it measured
# ("complete": false when killed), its output goes to DIR/gpu_check_STAGE.log. Runs from this
# checkout with PYTHONPATH=src and python3: nothing installed, no network. Exit code 0 when every
# stage exited 0, 2 on bad arguments, else 1.
set -u

usage="usage: $0 {first|second|third|eager|compile|probes|moe|fp8|zb} DIR [gpu_check.py options]"
declare -A BUDGET=([eager]=150 [compile]=420 [probes]=150 [moe]=60 [fp8]=180 [zb]=120)
GRACE_S=45

[ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }
group=$1
case $group in
  first) stages="eager probes moe" ;;
  second) stages="compile" ;;
  third) stages="fp8 zb" ;;
  eager | compile | probes | moe | fp8 | zb) stages=$group ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
mkdir -p "$2" && out=$(cd "$2" && pwd) || { echo "$0: cannot use $2 as the output folder" >&2; exit 2; }
shift 2
cd "$(dirname "$0")/.." || exit 2

if command -v nvidia-smi > /dev/null; then
  nvidia-smi > "$out/nvidia_smi.txt" 2>&1
fi
rc=0
for stage in $stages; do
  budget=${BUDGET[$stage]}
  echo "gpu_run.sh: stage $stage, budget $budget s, killed after $((budget + GRACE_S)) s" >&2
  PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" timeout -k 10 "$((budget + GRACE_S))" \
    python3 benchmarks/gpu_check.py "$stage" --output-dir "$out" --budget "$budget" "$@" 2>&1 |
    tee "$out/gpu_check_$stage.log"
  status=${PIPESTATUS[0]}
  if [ "$status" -ne 0 ]; then
    if [ "$status" -eq 2 ]; then  # gpu_check.py refused its arguments: so would the next stages
      echo "gpu_run.sh: stage $stage refused its arguments (exit 2); no further stage run" >&2
      exit 2
    fi
    case $status in
      124 | 137) why="killed at its time limit" ;;
      *) why="failed" ;;
    esac
    echo "gpu_run.sh: stage $stage exited with $status ($why)" >&2
    rc=1
  fi
done
exit $rc
