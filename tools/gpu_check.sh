#!/usr/bin/env bash
# rlbatch's GPU check: what the first GPU node must show, in one run of at most 420 s (7 minutes), with
# every figure and log written under $OUT.
#
#   bash tools/gpu_check.sh                       # on a node with an NVIDIA GPU (GPU 0 is used)
#   bash tools/gpu_check.sh --cpu                 # the same steps on the CPU (CI runs this:
#                                                 # tests/dist/test_gpu_check.py)
#   bash tools/gpu_check.sh --only bench,gpu_tests --budget 200
#
# On a machine lent through the `device` tool (Python 3.12 with torch and transformers, no network):
#   1. here, once:   bash tools/gpu_wheels.sh     # ~15 MiB of wheels the image lacks -> .gpu-wheels/
#   2. run:          command   "bash tools/gpu_check.sh"
#                    carry     [".gpu-wheels"]
#                    timeout_s 450                # the steps stop by 420 s (about 4 min when
#                                                 # nothing hangs); a machine's start is 1-2 min
#   3. to rerun a step (its dependencies come with it) within the 15 minutes of device time, at
#      once while the machine is warm: "bash tools/gpu_check.sh --only pipeline_hf --budget 180",
#      carry [".gpu-wheels"], timeout_s 210; then give the machine back.
#   Record the figures (summary.txt) in docs/benchmarks.md with the date and the device.
#
# Steps, in order, each under `timeout` (its cap, or what is left of --budget), each reported
# PASS, FAIL or NOT RUN with the reason:
#   setup          the packages rlbatch imports; on a GPU, missing ones installed from .gpu-wheels/
#                  (pip --no-index --no-deps into this Python; --cpu installs nothing)
#   versions       python, torch, CUDA, GPU, NCCL, driver, transformers, MPI, vllm
#   pipeline_hf    GRPO on one GPU: actor_train (fsdp), actor_infer (hf) and the reference take
#                  turns on GPU 0, a CPU reward worker scores; 2 steps, a checkpoint after each
#   resume_hf      the same run launched again: resumes from its last checkpoint, 1 more step
#   vllm_config    the vLLM pipeline's config through a dry run (validated and placed)
#   pipeline_vllm  the pipeline with vLLM colocated (sleep and wake between phases; a checkpoint
#                  between two generating steps); needs vLLM's CUDA build
#   resume_vllm    its resume
#   bench          tools/bench/gpu.py: training MFU, generation tokens/s of a Qwen2.5-0.5B-shape
#                  model, offload/reload bandwidth against a raw pinned copy
#   gpu_tests      pytest -m gpu tests/gpu (minus the tests whose launches the pipeline steps ran)
# Every launch has cluster.timeout_s=30: a hang ends in seconds, naming the ranks. The pipeline
# steps are tests/gpu/check.py, which tests/gpu/test_gpu.py runs too (the same launches).
#
# Writes to --out (default $OUT, else .gpu-check/out): summary.txt, check.json (versions, every
# step, figures), bench.json, logs.tar.gz (each step's log, each run's rank logs and metrics).
# Exit code: 0 no step failed, 1 a step failed, 2 bad arguments.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SELF="$REPO/tools/gpu_check.sh"
ALL_STEPS=(setup versions pipeline_hf resume_hf vllm_config pipeline_vllm resume_vllm bench gpu_tests)
declare -A CAP=([setup]=120 [versions]=60 [pipeline_hf]=150 [resume_hf]=120 [vllm_config]=60 [pipeline_vllm]=240
                [resume_vllm]=180 [bench]=240 [gpu_tests]=180)
declare -A NEEDS=([resume_hf]=pipeline_hf [pipeline_vllm]=vllm_config [resume_vllm]=pipeline_vllm)
declare -A PIPELINE_TESTS=([pipeline_hf]=tests/gpu/test_gpu.py::test_pipeline_on_one_gpu_in_bf16
                          [pipeline_vllm]=tests/gpu/test_gpu.py::test_vllm_colocated_sleeps_and_wakes_around_a_checkpoint_and_resumes)
RESERVE_S=15    # kept from --budget for the summary and the archive
NOT_RUN=3       # a step's exit code for "not run", its last line the reason

usage() { sed -n '2,/^set -uo/p' "$SELF" | sed '$d' | sed 's/^# \{0,1\}//'; }

# -- one step (run as `gpu_check.sh --step NAME` under timeout; the environment carries the rest) --

step_setup() {
    local missing
    missing=$("$PY" -m tests.gpu.check deps) || { echo "the dependency check itself failed"; return 1; }
    if [ -z "$missing" ]; then echo "every package rlbatch imports is there"; return 0; fi
    if [ "$MODE" = cpu ]; then echo "missing: $missing (--cpu installs nothing; make venv does)"; return 1; fi
    if ! compgen -G "$WHEELS/*.whl" >/dev/null; then
        echo "missing: $missing; no wheels in $WHEELS: run bash tools/gpu_wheels.sh where pip reaches PyPI, carry .gpu-wheels"
        return 1
    fi
    local pip=("$PY" -m pip install --no-index --no-deps --no-compile --no-cache-dir --find-links "$WHEELS")
    "${pip[@]}" $missing || { echo "pip could not install $missing from $WHEELS"; return 1; }
    local installed=$missing
    missing=$("$PY" -m tests.gpu.check deps) || { echo "the dependency check itself failed"; return 1; }
    if [ "$missing" = mpich ] && compgen -G "$WHEELS/mpi4py-*.whl" >/dev/null; then
        echo "MPI still fails with this Python's mpi4py: installing the carried one over it"
        "${pip[@]}" --force-reinstall mpi4py || { echo "pip could not install mpi4py from $WHEELS"; return 1; }
        installed="$installed mpi4py"
        missing=$("$PY" -m tests.gpu.check deps) || { echo "the dependency check itself failed"; return 1; }
    fi
    if [ -n "$missing" ]; then echo "still missing after installing $installed: $missing (see the reasons above)"; return 1; fi
    echo "installed from ${WHEELS#"$REPO"/}: $installed"
}

step_versions() {
    if command -v nvidia-smi >/dev/null; then nvidia-smi; fi
    "$PY" -m tests.gpu.check versions --device "$DEVICE" --json "$WORK/versions.json"
}

pipeline() {  # run|resume ENGINE
    "$PY" -m tests.gpu.check "$1" "$2" --device "$DEVICE" --root "$WORK/runs" --timeout $((STEP_CAP - 12)) \
        --json "$WORK/figures/${1/run/pipeline}_$2.json"
}

step_pipeline_hf() { pipeline run hf; }
step_resume_hf() { pipeline resume hf; }
step_vllm_config() { "$PY" -m tests.gpu.check config vllm --device cuda --root "$WORK/runs"; }

step_pipeline_vllm() {
    if [ "$MODE" = cpu ]; then
        echo "--cpu: this step checks vLLM's sleep and wake, which need CUDA (vLLM's CPU build has no sleep mode);" \
             "the colocated vLLM pipeline runs on CPU in tests/dist/test_vllm_pipeline.py"
        return $NOT_RUN
    fi
    pipeline run vllm
}

step_resume_vllm() { pipeline resume vllm; }

step_bench() {
    local args=(--json "$WORK/bench.json")
    if [ "$MODE" = cpu ]; then args+=(--cpu-smoke); fi
    "$PY" tools/bench/gpu.py "${args[@]}" || return
    echo "train, generate and offload measured: figures below"
}

step_gpu_tests() {
    local deselect=() step
    for step in $RAN; do
        if [ -n "${PIPELINE_TESTS[$step]:-}" ]; then deselect+=(--deselect "${PIPELINE_TESTS[$step]}"); fi
    done
    "$PY" -m pytest tests/gpu -m gpu -p no:cacheprovider -rA --junitxml "$WORK/gpu_tests.xml" "${deselect[@]}"
    local rc=$?
    "$PY" - "$WORK/gpu_tests.xml" "$rc" "${#deselect[@]}" <<'EOF'
import sys
import xml.etree.ElementTree as ET

path, rc, deselected = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) // 2
try:
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    n, failed, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "skipped"))
    failed += int(suite.get("errors", 0))
    reasons = sorted({s.get("message", "") for s in suite.iter("skipped")})
except (OSError, ET.ParseError, IndexError) as e:
    print(f"pytest exited with code {rc} and wrote no report ({e})")
    sys.exit(1)
note = f"{deselected} deselected (the pipeline steps above ran their launches)" if deselected else ""
if rc not in (0, 5) or failed:
    print(f"{failed} of {n} failed (pytest exit code {rc})" + (f"; {note}" if note else ""))
    sys.exit(1)
if n == skipped:
    print(f"all {n} collected tests skipped ({'; '.join(reasons)})" + (f"; {note}" if note else ""))
    sys.exit(3)
print(f"{n - skipped} passed, {skipped} skipped" + (f" ({'; '.join(reasons)})" if skipped else "") + (f"; {note}" if note else ""))
EOF
}

if [ "${1:-}" = --step ]; then
    cd "$REPO" || exit 1
    "step_$2"
    exit $?
fi

# -- the check ----------------------------------------------------------------------------------------

MODE=gpu
ONLY=""
BUDGET=""
OUT_DIR=${OUT:-$REPO/.gpu-check/out}
WORK=$REPO/.gpu-check/work
while [ $# -gt 0 ]; do
    case $1 in
        --cpu) MODE=cpu ;;
        --only) ONLY=${2:?--only needs a comma-separated list of steps}; shift ;;
        --budget) BUDGET=${2:?--budget needs seconds}; shift ;;
        --out) OUT_DIR=${2:?--out needs a directory}; shift ;;
        --work) WORK=${2:?--work needs a directory}; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$1' (--help lists them)" >&2; exit 2 ;;
    esac
    shift
done
BUDGET=${BUDGET:-$([ "$MODE" = cpu ] && echo 300 || echo 420)}
if ! [[ $BUDGET =~ ^[0-9]+$ ]] || [ "$BUDGET" -lt 60 ]; then echo "gpu_check.sh: --budget must be >= 60 seconds" >&2; exit 2; fi

declare -A SELECTED=()
if [ -z "$ONLY" ]; then
    for s in "${ALL_STEPS[@]}"; do SELECTED[$s]=1; done
else
    SELECTED=([setup]=1 [versions]=1)
    IFS=, read -ra asked <<<"$ONLY"
    for s in "${asked[@]}"; do
        if [ -z "${CAP[$s]:-}" ]; then echo "gpu_check.sh: no step '$s' (steps: ${ALL_STEPS[*]})" >&2; exit 2; fi
        while [ -n "$s" ]; do SELECTED[$s]=1; s=${NEEDS[$s]:-}; done  # a step brings what it needs
    done
fi

if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x "$REPO/.venv/bin/python" ]; then PY=$REPO/.venv/bin/python
else PY=$(command -v python3); fi
DEVICE=$([ "$MODE" = cpu ] && echo cpu || echo cuda)
export PY MODE DEVICE WORK WHEELS=${GPU_WHEELS:-$REPO/.gpu-wheels}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
WORK=$(realpath -m "$WORK") OUT_DIR=$(realpath -m "$OUT_DIR")
if [ -e "$WORK" ] && [ ! -f "$WORK/.gpu-check-work" ]; then
    echo "gpu_check.sh: $WORK exists and is not a work directory of this check: not clearing it" >&2
    exit 2
fi
rm -rf "$WORK"
mkdir -p "$WORK/logs" "$WORK/figures" "$WORK/runs" "$OUT_DIR" || exit 1
touch "$WORK/.gpu-check-work"
rm -f "$OUT_DIR/summary.txt" "$OUT_DIR/check.json" "$OUT_DIR/bench.json" "$OUT_DIR/logs.tar.gz"
cd "$REPO" || exit 1

START=$(date +%s)
DEADLINE=$((START + BUDGET))
declare -A STATUS=()
RAN=""
echo "rlbatch GPU check, $MODE mode, budget ${BUDGET}s, python $PY; logs in $WORK/logs"

record() {  # NAME STATUS SECONDS REASON
    STATUS[$1]=$2
    local reason=${4//$'\t'/ }
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${reason:0:400}" >>"$WORK/steps.tsv"
    printf '[%4ds] %-14s %-8s %4ss  %s\n' $(($(date +%s) - START)) "$1" "$2" "$3" "${reason:0:200}"
}

blocked() {  # why NAME cannot run now, or nothing
    local name=$1 need=${NEEDS[$1]:-}
    if [ -n "$need" ] && [ "${STATUS[$need]:-}" != PASS ]; then echo "needs $need (${STATUS[$need]:-not run})"; return; fi
    if [ "$name" != setup ] && [ "$name" != versions ] && [ "${STATUS[setup]:-}" = FAIL ]; then echo "setup failed"; return; fi
    if [ "$MODE" = gpu ] && [ "$name" != setup ] && [ "$name" != versions ] && [ "$name" != vllm_config ] \
        && [ "${STATUS[versions]:-}" = FAIL ]; then
        echo "versions failed (no CUDA device?)"
    fi
}

for name in "${ALL_STEPS[@]}"; do
    if [ -z "${SELECTED[$name]:-}" ]; then record "$name" "NOT RUN" 0 "not selected (--only $ONLY)"; continue; fi
    why=$(blocked "$name")
    if [ -n "$why" ]; then record "$name" "NOT RUN" 0 "$why"; continue; fi
    left=$((DEADLINE - $(date +%s) - RESERVE_S))
    if [ "$left" -lt 20 ]; then record "$name" "NOT RUN" 0 "the ${BUDGET}s budget is spent"; continue; fi
    cap=${CAP[$name]}
    if [ "$cap" -gt "$left" ]; then cap=$left; fi
    log=$WORK/logs/$name.log
    t0=$(date +%s)
    STEP_CAP=$cap RAN=$RAN timeout -k 10 "$cap" bash "$SELF" --step "$name" >"$log" 2>&1
    rc=$?
    secs=$(($(date +%s) - t0))
    last=$(grep -v '^[[:space:]]*$' "$log" | tail -n 1)
    if [ "$rc" != "$NOT_RUN" ]; then RAN="$RAN $name"; fi  # steps that launched (gpu_tests skips their tests)
    case $rc in
        0) record "$name" PASS "$secs" "$last" ;;
        "$NOT_RUN") record "$name" "NOT RUN" "$secs" "$last" ;;
        124|137) record "$name" FAIL "$secs" "timed out after ${cap}s (its cap); the log ends: $last" ;;
        *) record "$name" FAIL "$secs" "exit code $rc: $last" ;;
    esac
done

# -- summary, figures, archive --------------------------------------------------------------------------
[ -f "$WORK/bench.json" ] && cp "$WORK/bench.json" "$OUT_DIR/"
tar -czf "$OUT_DIR/logs.tar.gz" -C "$WORK" --exclude=checkpoints --exclude=tensorboard --exclude='*.png' \
    logs runs $(cd "$WORK" && ls versions.json gpu_tests.xml 2>/dev/null) 2>/dev/null
echo
"$PY" -m tests.gpu.check report --work "$WORK" --out "$OUT_DIR" --mode "$MODE"
if [ ! -f "$OUT_DIR/summary.txt" ]; then  # the report itself broke: the step table, plainly
    cp "$WORK/steps.tsv" "$OUT_DIR/summary.txt"
    cat "$OUT_DIR/summary.txt"
fi
echo "($(($(date +%s) - START)) s; wrote $(cd "$OUT_DIR" && ls | tr '\n' ' ')to $OUT_DIR)"
if grep -q $'\tFAIL\t' "$WORK/steps.tsv"; then exit 1; fi
exit 0
