#!/usr/bin/env bash
# GPU validation of dask_pgas on the device machine (one H200), in 3 back-to-back device calls:
#
#   call 1: carry [".gpu-stage/part-aa", ".gpu-stage/SHA256SUMS"]  command: bash scripts/gpu/stage_and_test.sh upload
#   call 2: carry [".gpu-stage/part-ab", ".gpu-stage/SHA256SUMS"]  command: bash scripts/gpu/stage_and_test.sh upload mps
#   call 3: carry [".gpu-stage/part-ac", ".gpu-stage/SHA256SUMS"]  command: bash scripts/gpu/stage_and_test.sh test
#
# (the parts come from ../shared/tools/stage-cufftmp cu13 .gpu-stage, run here once). Each upload copies its
# part to /tmp/stage at once and does NVSHMEM-only work (bindings, unique-id bring-up, control plane over
# NVSHMEM, CPU tests); "test" reassembles cuFFTMp, then runs the GPU tests, the core suite with --backend
# nvshmem at 1, 2 and 4 PEs without and with MPS, and the benchmark. Logs: $OUT/*.log, summary in $OUT/summary.txt.
# Environment knobs: EXAMPLES (hypothesis examples per suite run, default 15), BUDGET_S (stop starting steps after
# this many seconds, default 540), SKIP_MPS=1, STEPS (space-separated subset of: pytest checks uid suite bench mps),
# SUITE_CFGS (e.g. "2:torch 4:torch"; PEs:package pairs for the core suite), MPS_NP (default "2 4").
set -u
MODE=${1:-test}
SUB=${2:-}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/stage
START=$(date +%s)
BUDGET_S=${BUDGET_S:-540}
EXAMPLES=${EXAMPLES:-15}
STEPS=${STEPS:-"pytest checks uid bench suite mps"}
export PYTHONUNBUFFERED=1 NVSHMEM_DISABLE_NVLS=1 NVSHMEM_REMOTE_TRANSPORT=none \
       NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo NVSHMEM_SYMMETRIC_SIZE=${NVSHMEM_SYMMETRIC_SIZE:-8g} \
       NVSHMEM_DISABLE_NCCL=1 OMP_NUM_THREADS=1
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
SUMMARY=$OUT/summary.txt
# local ranks inherit mpirun's environment (one node), so no -x flags are needed
MPIRUN="mpirun --allow-run-as-root --oversubscribe --bind-to none"

left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
note() { echo "$*" | tee -a "$SUMMARY"; }
# step NAME TIMEOUT LOG cmd...: run under timeout, record rc and seconds
step() {
  local name=$1 to=$2 log=$3; shift 3
  if [ "$(left)" -lt 20 ]; then note "SKIP $name (budget)"; return 0; fi
  [ "$to" -gt "$(left)" ] && to=$(left)
  local t0=$(date +%s)
  echo "=== $name: $*" >>"$log"
  timeout -k 5 "$to" "$@" >>"$log" 2>&1
  local rc=$?
  note "$( [ $rc -eq 0 ] && echo PASS || echo "FAIL(rc=$rc)" ) $name $(( $(date +%s) - t0 ))s"
  return 0
}
want() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }

mps_start() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d && note "MPS started"
}
mps_stop() { echo quit | nvidia-cuda-mps-control 2>/dev/null; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; }
trap 'mps_stop >/dev/null 2>&1' EXIT

if [ "$MODE" = upload ]; then
  cp .gpu-stage/part-* .gpu-stage/SHA256SUMS /tmp/stage/ 2>/dev/null
  note "staged: $(ls /tmp/stage | tr '\n' ' ')"
  LOG=$OUT/upload.log
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$SUMMARY" 2>&1
  python3 -c "import nvidia.nvshmem, cupy, torch, mpi4py; print('nvshmem', nvidia.nvshmem.__path__, 'cupy', cupy.__version__, 'torch', torch.__version__)" >>"$SUMMARY" 2>&1
  [ "$SUB" = copy ] && exit 0   # only stage the part (a repeat round)
  [ "$SUB" = mps ] && { export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50; mps_start; }
  step "cpu-tests" 120 "$LOG" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_planning_cpu.py
  for np_ in 1 2 4; do
    [ "$SUB" = mps ] && export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100/np_))
    rm -f /tmp/uid.bin
    step "uid-bootstrap-nvshmem-only np=$np_${SUB:+ $SUB}" 90 "$LOG" $MPIRUN -n $np_ python3 tests/gpu/programs/uid_checks.py /tmp/uid.bin --no-reshape
  done
  exit 0
fi

# ---- test: reassemble cuFFTMp ----
cp .gpu-stage/part-* .gpu-stage/SHA256SUMS /tmp/stage/ 2>/dev/null
if [ ! -e /tmp/site/nvidia/cufftmp/cu13/lib/libcufftMp.so.12 ]; then
  ( cd /tmp/stage && cat part-* > cufftmp-cu13-lib.tar.xz && sha256sum -c SHA256SUMS ) >>"$SUMMARY" 2>&1 || { note "FAIL staging checksum"; exit 1; }
  mkdir -p /tmp/site/nvidia/cufftmp/cu13 && xz -dc -T0 /tmp/stage/cufftmp-cu13-lib.tar.xz | tar -x -C /tmp/site/nvidia/cufftmp/cu13
  ln -sfn "$(python3 -c 'import nvidia.nvshmem, os; print(list(nvidia.nvshmem.__path__)[0])')" /tmp/site/nvidia/nvshmem
fi
ls -la /tmp/site/nvidia/cufftmp/cu13/lib >>"$SUMMARY" 2>&1
TLOG=$OUT/tests.log; SLOG=$OUT/suite.log; BLOG=$OUT/bench.log; MLOG=$OUT/mps.log
python3 -c "from dask_pgas.engines.nvshmem import NVSHMEMEngine as E; print('unavailable_reason:', E.unavailable_reason())" >>"$SUMMARY" 2>&1

# cuFFTMp and empty boxes: probe, and route around it when it fails
if timeout -k 5 60 $MPIRUN -n 2 python3 tests/gpu/programs/empty_probe.py >>"$TLOG" 2>&1; then
  note "EMPTY_PROBE cuFFTMp accepts empty boxes: yes"; export DASK_PGAS_EMPTY_VIA_PEER=0
else
  note "EMPTY_PROBE cuFFTMp accepts empty boxes: NO (routing empty-box reshapes through peer copies)"; export DASK_PGAS_EMPTY_VIA_PEER=1
fi

# pytest tests/gpu: the CPU planning tests plus gpu_checks and uid_checks at 1 and 2 PEs
want pytest && step "pytest tests/gpu" 300 "$TLOG" python3 -m pytest -q -p no:cacheprovider -m "gpu or not gpu" tests/gpu
if want checks; then for np_ in ${CHECK_NP:-4}; do
  step "gpu_checks np=$np_" 150 "$TLOG" $MPIRUN -n $np_ python3 tests/gpu/programs/gpu_checks.py
done; fi
if want uid; then for np_ in 4; do
  rm -f /tmp/uid.bin
  step "uid_checks np=$np_" 90 "$TLOG" $MPIRUN -n $np_ python3 tests/gpu/programs/uid_checks.py /tmp/uid.bin
done; fi
if want bench; then for np_ in 1 2 4; do
  step "bench np=$np_" 120 "$BLOG" $MPIRUN -n $np_ python3 benchmarks/bench_gpu_reshape.py
done; fi
SUITE=tests/mpi/programs/reshape_suite.py
if want suite && [ -e $SUITE ]; then
  for cfg in ${SUITE_CFGS:-1:cupy 2:cupy 4:cupy 2:torch 4:torch 2:numpy 4:numpy}; do
    set -- ${cfg/:/ }
    step "core suite np=$1 --package $2" 150 "$SLOG" $MPIRUN -n $1 python3 $SUITE --backend nvshmem --package $2 --examples $EXAMPLES
  done
fi
if want mps && [ "${SKIP_MPS:-0}" != 1 ]; then
  mps_start
  for np_ in ${MPS_NP:-2 4}; do
    export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100/np_))
    step "MPS gpu_checks np=$np_" 150 "$MLOG" $MPIRUN -n $np_ python3 tests/gpu/programs/gpu_checks.py
    step "MPS bench np=$np_" 120 "$BLOG" $MPIRUN -n $np_ python3 benchmarks/bench_gpu_reshape.py
    [ -e $SUITE ] && step "MPS core suite np=$np_ --package cupy" 150 "$MLOG" $MPIRUN -n $np_ python3 $SUITE --backend nvshmem --package cupy --examples $EXAMPLES
  done
  mps_stop
fi
grep -h '^BENCH ' "$BLOG" >>"$SUMMARY" 2>/dev/null
grep -h '^CHECK .*FAIL\|^INFO ' "$TLOG" "$MLOG" 2>/dev/null | sort | uniq -c >>"$SUMMARY"
note "elapsed $(( $(date +%s) - START ))s"
