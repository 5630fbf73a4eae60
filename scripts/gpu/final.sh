#!/usr/bin/env bash
# GPU validation on the device machine (one H200). cuFFTMp is too big for one upload, so a session makes three
# back-to-back device calls (the machine keeps /tmp while it stays warm, 30 s after a call):
#   1: carry [".gpu-stage/part-ac", ".whl"]                             bash scripts/gpu/final.sh upload
#   2: carry [".gpu-stage/part-aa", ".gpu-stage/SHA256SUMS"]            bash scripts/gpu/final.sh upload2
#   3: carry [".gpu-stage/part-ab"]                                      BUDGET=560 bash scripts/gpu/final.sh JOB...
# (at most 64 MiB per call: the smallest part travels with the wheels). The parts come from
# `../shared/tools/stage-cufftmp cu13 .gpu-stage`; .whl holds the cp312 wheels of dask, distributed, dask-mpi
# and all their dependencies, plus hypothesis (`pip download --only-binary=:all: --python-version 3.12
# --platform manylinux_2_17_x86_64 --platform any dask==... distributed==... hypothesis`, dask-mpi and dask-cuda with
# --no-deps); the host lacks some of them (tornado, in session 10). `upload` installs the wheels and runs the CPU-side
# tests there; `upload2` brings NVSHMEM up from a unique id at 1, 2 and 4 PEs (no cuFFTMp needed); either may be
# followed by the jobs that need no cuFFTMp (robust, cpubench), so that the upload calls do real work too. Any other
# call reassembles cuFFTMp once (when not there yet) and runs its JOBs in order:
#   robust    the core's collective-check programs and random-layout suite under Open MPI (mpi backend)
#   engine    pytest tests/gpu, then the core's bad-input and symmetric-memory programs on NVSHMEM with CuPy and
#             torch (pytest -m gpu tests/mpi/test_reshape_mpi.py); beside them gpu_checks at 1, 2 and 4 PEs (and at 3
#             with DASK_PGAS_EMPTY_VIA_PEER=1), tests/gpu/programs/empty_probe.py at 2 and 3 PEs, and the
#             core suite (random layouts against NumPy) with CuPy, torch and NumPy at 2-4 PEs
#   mps       gpu_checks, the CuPy core suite and the Dask suite at 2 and 4 PEs under MPS
#   dask      the Dask suite on 1, 2 and 4 GPU workers and on 2 outside MPI (side by side), then the failure tests
#   fuzz      new random cases each round (FUZZ_SEED replays one): the core suite with --seed (CuPy at 2, 3 and 4
#             PEs, torch at 3, NumPy at 2) beside the Dask suite's random rechunks and selections on 2 and 4 GPU
#             workers with --hypothesis-seed (about 4 minutes)
#   cputimeline  benchmarks/timeline_rechunk.py --cpu on 4 CPU workers at n=1024 and 8192 (16 cores; may follow
#             upload); with TL_ALT=1 alternately with the package in .gpu-old (a candidate change, say)
#   timeline  the same on 2 and 4 GPU workers sharing the GPU at n=4096 and 32768
#   checks    gpu_checks alone, at 1, 2 and 4 PEs and at 3 with DASK_PGAS_EMPTY_VIA_PEER=1 (a short call, when
#             little device time is left: the engine's own checks, peer copies included)
#   sbsuid    the same bring-up without Dask or cuFFTMp: 4 jobs of 4 PEs (uid_checks.py --no-reshape) at once,
#             SBS_ROUNDS times, with this package and (SBS_OLD=1) the one in .gpu-old; may follow `upload`
#   sidebyside  4 LocalMPICluster worlds of 4 GPU workers started at once, SBS_ROUNDS (4) times: the bring-up
#             death rounds 12a, 34a and 35 saw (scripts/gpu/probe_side_by_side.py); with SBS_OLD=1 also with the package in .gpu-old (`git archive REV dask_pgas | tar -x -C .gpu-old`,
#             carried in the `upload` call)
#   dasksuites  the four Dask suites of `dask` (1, 2 and 4 GPU workers, 2 outside MPI) without its failure tests (70-120 s)
#   dask4     the Dask suite on 4 GPU workers alone (a quick check after a change to the Dask layer)
#   dask1     the same on 1 GPU worker
#   failure   the Dask failure and launcher tests alone (tests/dask/test_failure.py, 3 GPU workers)
#   cancel    the two cancel tests, 5 times on 4 GPU workers
#   notebook  notebooks/01_pgas_rechunk.ipynb cell by cell on 1 and 2 GPU workers (1 GiB)
#   demo      the README's main job (embedded default: one worker per GPU)
#   enginebench  the engine benchmark at 1, 2 and 4 PEs (Reshape.execute against the bare plan and a D2D copy)
#   bench     the engine benchmark at 1, 2 and 4 PEs; the rechunk benchmark on 1, 2 and 4 workers beside Dask
#   large     the rechunk benchmark on 1 worker at 32, 48 and 56 GiB (LARGE_SIZES=24GiB,32GiB on a 78 GiB H100)
#   cpubench  the CPU rechunk benchmark (4 CPU workers, MPI engine) S1 and S3 on this host's 16 cores
#   p2p       Dask p2p on CuPy chunks without dask_pgas, as released and with the candidate fix
#   heap      what a full NVSHMEM heap does (probe), growing and fixed
#   userenv   as a user runs it: none of this script's NVSHMEM settings but NVSHMEM_DISABLE_NVLS=1 (the package's
#             own defaults then apply): the main job, the Dask suite on 2 workers outside MPI (unique-id
#             bootstrap), the dask-cuda example, gpu_checks at 2 PEs
#   bind      which GPU each PE took, and whether bootstrap warned, on LocalMPICluster(gpus=1) and LocalCluster
#             workers (2 each; one GPU visible to each, so no warning is expected)
#   handle    what cuFFTMp's reshape handle does after a failed set-up (scripts/gpu/probe_handle.py, 2 PEs)
#   deverror  a real sticky device error (a kernel's illegal address on the last PE; no MPS) at 1, 2 and 3 PEs:
#             every PE raises DeviceError at the next collective free, later calls too, finalize() returns
#             (tests/gpu/programs/device_error.py)
#   exit      what a process does at exit without finalize() (nvmath's examples never call it), at 2 PEs: with its
#             symmetric arrays freed, still held, and finalized as the reference (scripts/gpu/probe_exit.py)
#   daskcuda  dask-cuda's LocalCUDACluster (workers not launched by MPI, default backends): the Dask suite on 1
#             worker (one per GPU), then examples/dask_cuda_rechunk.py (the dask-cuda wheel travels in .whl, `pip
#             download --no-deps dask-cuda`: the host has its dependencies cuda-core and nvidia-ml-py). Rounds 32-34
#             used 26.10.0; in sessions 36-37 the index offered only 25.10.0 (it requires cuda-core 0.3; the host
#             has 1.2.0); 26.10.0 is back in session 38 (its wheel is tagged manylinux_2_28: download it with
#             --platform manylinux_2_28_x86_64, or without --platform)
# Logs go to $OUT/logs.tar.gz (one or more per job, packed at the end: the device tool returns few files); PASS/FAIL
# lines and the key numbers to $OUT/summary.txt. A step that
# would start with less than 15 s of BUDGET left is skipped. (Rounds 1-10 of docs/gpu-validation.md name the
# per-session modes this script had at their trees; they are in the git history.)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/stage /tmp/site
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 NVSHMEM_DISABLE_NVLS=1 NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo \
       NVSHMEM_SYMMETRIC_SIZE=8g NVSHMEM_DISABLE_NCCL=1 OMP_NUM_THREADS=1 \
       OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export PYTHONPATH=/tmp/site:$PWD
S=$OUT/summary.txt
START=$(date +%s); BUDGET=${BUDGET:-520}
MPIRUN="mpirun --bind-to none"
SUITE=tests/mpi/programs/reshape_suite.py

left() { echo $(( BUDGET - ($(date +%s) - START) )); }
# the device tool brings back only a few files per call: every log goes into one archive beside summary.txt
pack_logs() { (cd "$OUT" && ls ./*.log >/dev/null 2>&1 && tar -czf logs.tar.gz --remove-files ./*.log); true; }
# step NAME TIMEOUT LOG cmd...: run under a timeout, record PASS/FAIL and seconds in the summary
step() {
  local name=$1 to=$2 log=$3; shift 3
  if [ "$(left)" -lt 15 ]; then echo "SKIP $name (budget)" >>"$S"; return 0; fi
  [ "$to" -gt "$(left)" ] && to=$(left)
  local t0=$(date +%s)
  echo "=== $name: $*" >>"$log"
  timeout -k 5 "$to" "$@" >>"$log" 2>&1
  local rc=$?
  echo "$( [ $rc -eq 0 ] && echo PASS || echo "FAIL(rc=$rc)" ) $name $(( $(date +%s) - t0 ))s" >>"$S"
}
mps_start() {  # MPS control daemon for the steps that follow (each sets CUDA_MPS_ACTIVE_THREAD_PERCENTAGE)
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  trap 'echo quit | nvidia-cuda-mps-control >/dev/null 2>&1' EXIT
  nvidia-cuda-mps-control -d && echo "MPS started" >>"$S"
}
mps_stop() {
  echo quit | nvidia-cuda-mps-control >/dev/null 2>&1; echo "MPS stopped" >>"$S"
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
  trap - EXIT
}
# core_suite NP PACKAGE EXAMPLES TIMEOUT LOG: the engine's random-layout suite against NumPy
core_suite() {
  step "core suite np=$1 $2" "$4" "$5" $MPIRUN -n "$1" python3 $SUITE --backend nvshmem --package "$2" --examples "$3"
}
# dask_suite K TIMEOUT LOG [local]: tests/dask/test_rechunk.py on K GPU workers of LocalMPICluster, or with
# "local" on K LocalCluster workers outside MPI (unique-id bootstrap)
dask_suite() {
  if [ "${4:-}" = local ]; then
    step "dask suite, $1 GPU workers outside MPI (LocalCluster, unique-id bootstrap)" "$2" "$3" \
      env DASK_PGAS_TEST_GPU_WORKERS="$1" DASK_PGAS_TEST_CLUSTER=local python3 -m pytest -q -p no:cacheprovider tests/dask/test_rechunk.py
  else
    step "dask suite, $1 GPU workers" "$2" "$3" \
      env DASK_PGAS_TEST_GPU_WORKERS="$1" DASK_PGAS_TEST_CLUSTER_LOG="${3%.log}-cluster.log" \
      python3 -m pytest -q -p no:cacheprovider tests/dask/test_rechunk.py
  fi
}
rechunk_bench() {  # rechunk_bench K SIZES TIMEOUT LOG [ARGS...]
  local k=$1 sizes=$2 to=$3 log=$4; shift 4
  step "rechunk bench, $k GPU worker(s), $sizes" "$to" "$log" \
    python3 benchmarks/bench_rechunk_gpu.py --workers "$k" --sizes "$sizes" "$@"
}

# gpu_checks LOG: tests/gpu/programs/gpu_checks.py at 1, 2 and 4 PEs, and at 3 with empty boxes moved through
# peer copies (the engine and checks jobs)
gpu_checks() {
  for np_ in 1 2 4; do
    step "gpu_checks np=$np_" 100 "$1" $MPIRUN -n $np_ python3 tests/gpu/programs/gpu_checks.py
  done
  step "gpu_checks np=3 DASK_PGAS_EMPTY_VIA_PEER=1" 100 "$1" \
    env DASK_PGAS_EMPTY_VIA_PEER=1 $MPIRUN -n 3 python3 tests/gpu/programs/gpu_checks.py
}

# ---------------------------------------------------------------- jobs
job_engine() {
  ( step "pytest tests/gpu" 240 "$OUT/engine-pytest.log" python3 -m pytest -q -p no:cacheprovider tests/gpu
    step "the core's bad-input and symmetric-memory programs on NVSHMEM (CuPy, torch)" 240 "$OUT/engine-pytest.log" \
      python3 -m pytest -q -rA -p no:cacheprovider -m gpu tests/mpi/test_reshape_mpi.py ) &
  ( gpu_checks "$OUT/engine.log"
    # empty boxes both ways: through cuFFTMp (empty_probe forces it) and around it (gpu_checks' EMPTY_VIA_PEER run)
    for np_ in 2 3; do
      step "empty_probe np=$np_ (cuFFTMp with an empty box)" 60 "$OUT/engine.log" \
        $MPIRUN -n $np_ python3 tests/gpu/programs/empty_probe.py
    done
    core_suite 3 cupy 10 100 "$OUT/engine.log"
    core_suite 4 torch 30 100 "$OUT/engine.log"
    core_suite 2 numpy 10 100 "$OUT/engine.log"
    core_suite 2 torch-cpu 10 100 "$OUT/engine.log" ) &
  wait
  grep -h "passed\|failed" "$OUT/engine-pytest.log" | tail -2 >>"$S"
}
job_fuzz() {  # new random cases (the suites above draw the same ones every round): FUZZ_SEED replays a round
  local seed=${FUZZ_SEED:-$(( $(od -An -N4 -tu4 /dev/urandom) % 2147483647 ))}
  echo "fuzz seed $seed (FUZZ_SEED=$seed replays it)" >>"$S"
  ( for np_ in 2 3 4; do
      step "fuzz: core suite np=$np_ cupy --seed $((seed + np_))" 150 "$OUT/fuzz.log" \
        $MPIRUN -n $np_ python3 $SUITE --backend nvshmem --package cupy --examples 150 --seed $((seed + np_))
    done
    step "fuzz: core suite np=3 torch --seed $seed" 150 "$OUT/fuzz.log" \
      $MPIRUN -n 3 python3 $SUITE --backend nvshmem --package torch --examples 100 --seed $seed
    step "fuzz: core suite np=2 numpy --seed $seed" 120 "$OUT/fuzz.log" \
      $MPIRUN -n 2 python3 $SUITE --backend nvshmem --package numpy --examples 60 --seed $seed ) &
  ( for k in 2 4; do
      step "fuzz: dask suite's random rechunks and selections, $k GPU workers, --hypothesis-seed=$seed" 240 \
        "$OUT/fuzz-dask$k.log" env DASK_PGAS_TEST_GPU_WORKERS=$k python3 -m pytest -q -p no:cacheprovider \
        tests/dask/test_rechunk.py -k "matches_numpy or selections_match" --hypothesis-seed=$seed
    done ) &
  wait
  grep -h "passed\|failed" "$OUT"/fuzz-dask*.log >>"$S" 2>/dev/null
  grep -h "^OK rank=0" "$OUT/fuzz.log" >>"$S" 2>/dev/null
}
# timeline TAG ARGS...: benchmarks/timeline_rechunk.py with this tree's package, and (TL_ALT=1) alternately with
# the one `upload` copied from .gpu-old to /tmp/old, twice each (medians of 9 repeats per run)
timeline() {
  local tag=$1 tree; shift
  for round in 1 2; do
    for tree in $PWD ${TL_ALT:+/tmp/old}; do
      step "timeline $tag ($([ "$tree" = "$PWD" ] && echo this || echo old) package, run $round)" 120 \
        "$OUT/timeline.log" env PYTHONPATH="$tree:$PYTHONPATH" python3 benchmarks/timeline_rechunk.py --repeats 9 "$@"
      [ -n "${TL_ALT:-}" ] || break 2
    done
  done
}
job_cputimeline() {  # where a collective rechunk's time goes on this host's 16 cores (no oversubscription): 4 CPU
  # workers, n=1024 (8 MiB: a short exchange) and S1 (512 MiB: a long one); needs no cuFFTMp
  timeline "4 CPU workers, n=1024" --workers 4 --n 1024 --cpu
  timeline "4 CPU workers, n=8192" --workers 4 --n 8192 --cpu
}
job_timeline() {  # the same on 2 and 4 GPU workers sharing the GPU, n=4096 (128 MiB) and 32768 (8 GiB)
  for k in 2 4; do
    for n in 4096 32768; do
      timeline "$k GPU workers, n=$n" --gpu --workers $k --n $n --cpu
    done
  done
}
job_checks() {
  gpu_checks "$OUT/checks.log"
  grep -h "^FAIL\|Error" "$OUT/checks.log" | head -20 >>"$S" 2>/dev/null
}
job_mps() {
  mps_start
  for np_ in 2 4; do
    export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / np_))
    step "gpu_checks np=$np_ (MPS)" 60 "$OUT/mps.log" $MPIRUN -n $np_ python3 tests/gpu/programs/gpu_checks.py
    core_suite $np_ cupy 8 60 "$OUT/mps.log"
    dask_suite $np_ 150 "$OUT/mps-dask$np_.log"
  done
  mps_stop
  grep -h "passed\|failed" "$OUT"/mps-dask*.log >>"$S" 2>/dev/null
}
job_robust() {
  step "core collective checks and random layouts under Open MPI (mpi backend, 1-4 ranks)" 240 "$OUT/robust.log" \
    python3 -m pytest -q -p no:cacheprovider tests/mpi/test_collective_setup.py tests/mpi/test_reshape_calls.py \
      tests/mpi/test_reshape_mpi.py
  grep -h "passed\|failed" "$OUT/robust.log" >>"$S" 2>/dev/null
}
job_dasksuites() {
  for k in 1 2 4; do
    dask_suite $k 200 "$OUT/dask$k.log" &
  done
  dask_suite 2 200 "$OUT/dask-nanny2.log" local &
  wait
  grep -h "passed\|failed" "$OUT"/dask[0-9]*.log "$OUT"/dask-nanny*.log >>"$S" 2>/dev/null
}
job_dask() {
  job_dasksuites
  job_failure
}
job_failure() {
  step "dask failure tests, 3 GPU workers (kill) and 2 (full heap)" 400 "$OUT/dask-failure.log" \
    env DASK_PGAS_TEST_GPU_WORKERS=3 python3 -m pytest -q -rA -p no:cacheprovider --durations=8 tests/dask/test_failure.py
  grep -h "passed\|failed" "$OUT/dask-failure.log" >>"$S" 2>/dev/null
}
job_sidebyside() {  # SBS_ROUNDS rounds of 4 clusters x 4 GPU workers started at once (rounds 12a and 34a's failure),
  # with this tree's package, then (SBS_OLD=1) with an older one that `upload` copied from .gpu-old to /tmp/old
  local tree log
  for tree in $PWD ${SBS_OLD:+/tmp/old}; do
    log=$OUT/sidebyside-$([ "$tree" = "$PWD" ] && echo this || echo old).log
    step "side by side: 4 LocalMPICluster x 4 GPU workers at once, ${SBS_ROUNDS:-4} rounds, package $tree" 300 \
      "$log" env PYTHONPATH="$tree:$PYTHONPATH" \
      python3 scripts/gpu/probe_side_by_side.py --clusters 4 --workers 4 --rounds "${SBS_ROUNDS:-4}"
    grep -h "^FAIL\|^WRONG\|side by side:\|package" "$log" | cut -c1-200 >>"$S"
    grep -h "init.cu\|cuda failed\|host lock" "$log" | sort | uniq -c | head >>"$S"
  done
}
job_sbsuid() {  # SBS_ROUNDS rounds of 4 NVSHMEM-only jobs of 4 PEs (uid_checks --no-reshape) started at once on
  # the GPU, with this tree's package and with the one in /tmp/old (SBS_OLD=1): no cuFFTMp needed
  local tree tag r k log
  for tree in $PWD ${SBS_OLD:+/tmp/old}; do
    tag=$([ "$tree" = "$PWD" ] && echo this || echo old) log=$OUT/sbsuid-$tag.log
    local failed=0 ran=0 t0=$(date +%s)
    for r in $(seq "${SBS_ROUNDS:-4}"); do
      [ "$(left)" -lt 30 ] && { echo "SKIP sbsuid $tag round $r (budget)" >>"$S"; break; }
      for k in 1 2 3 4; do
        rm -f /tmp/sbs-uid-$k.bin
        ( echo "=== $tag round $r job $k" >"$log.$k"
          timeout -k 5 60 env PYTHONPATH="$tree:$PYTHONPATH" $MPIRUN -n 4 python3 tests/gpu/programs/uid_checks.py \
            /tmp/sbs-uid-$k.bin --no-reshape >>"$log.$k" 2>&1; printf '\nrc=%s\n' $? >>"$log.$k" ) &
      done
      wait
      for k in 1 2 3 4; do
        grep -q "^rc=0" "$log.$k" || failed=$((failed + 1)); ran=$((ran + 1)); cat "$log.$k" >>"$log"; rm -f "$log.$k"
      done
    done
    echo "side by side (NVSHMEM only), package $tree: $failed of $ran jobs failed, $(( $(date +%s) - t0 ))s" >>"$S"
    grep -h "init.cu\|cuda failed\|host lock\|shared memory" "$log" | sort | uniq -c | head >>"$S"
  done
}
job_dask4() {
  dask_suite 4 200 "$OUT/dask4.log"
  grep -h "passed\|failed" "$OUT/dask4.log" >>"$S" 2>/dev/null
}
job_dask1() {
  dask_suite 1 200 "$OUT/dask1.log"
  grep -h "passed\|failed" "$OUT/dask1.log" >>"$S" 2>/dev/null
}
job_cancel() {
  for i in 1 2 3 4 5; do
    step "cancel tests, 4 GPU workers, try $i" 60 "$OUT/cancel.log" \
      env DASK_PGAS_TEST_GPU_WORKERS=4 python3 -m pytest -q -p no:cacheprovider tests/dask/test_rechunk.py -k cancelled
  done
}
job_notebook() {
  for k in 1 2; do
    step "notebook, $k GPU worker(s), 1 GiB" 150 "$OUT/notebook$k.log" \
      env DASK_PGAS_NOTEBOOK_WORKERS="$k" DASK_PGAS_NOTEBOOK_SIZE=1GiB python3 scripts/gpu/run_notebook.py notebooks/01_pgas_rechunk.ipynb
    grep -h "GB/s\|checked\|available\|PE \|Error" "$OUT/notebook$k.log" >>"$S" 2>/dev/null
  done
}
job_demo() {
  step "main job (dask-pgas demo, embedded default: one worker per GPU)" 120 "$OUT/demo.log" python3 -m dask_pgas.cli demo
  grep -h "GB/s\|pgas vs\|copy\|WRONG" "$OUT/demo.log" >>"$S" 2>/dev/null
}
job_enginebench() {
  for np_ in 1 2 4; do
    step "engine bench np=$np_" 60 "$OUT/bench.log" $MPIRUN -n $np_ python3 benchmarks/bench_gpu_reshape.py
  done
  grep -h "^BENCH" "$OUT/bench.log" >>"$S" 2>/dev/null
}
job_bench() {
  job_enginebench
  rechunk_bench 1 512MiB,4GiB,16GiB 200 "$OUT/bench-rechunk1.log" --repeats 5 --p2p-cupy-fix
  rechunk_bench 2 1GiB,4GiB 200 "$OUT/bench-rechunk2.log" --repeats 3 --p2p-cupy-fix
  rechunk_bench 4 1GiB 150 "$OUT/bench-rechunk4.log" --repeats 3 --p2p-cupy-fix
  grep -h "GB/s\|floor\|Error\|worker" "$OUT"/bench-rechunk*.log >>"$S" 2>/dev/null
}
job_cpubench() {  # the CPU benchmark (MPI engine, 4 CPU workers, no GPU) on this host's 16 cores: S1, then S3
  step "CPU rechunk bench S1, 4 CPU workers" 240 "$OUT/cpubench.log" \
    python3 benchmarks/bench_rechunk.py --scenarios S1 --repeats 3 --rounds 5
  step "CPU rechunk bench S3, 4 CPU workers" 150 "$OUT/cpubench.log" \
    python3 benchmarks/bench_rechunk.py --scenarios S3 --repeats 3  # with S4 too it ran past 200 s (round 12)
  grep -h "^| S\|by round\|^# \|Error" "$OUT/cpubench.log" >>"$S" 2>/dev/null
}
job_large() {
  rechunk_bench 1 "${LARGE_SIZES:-32GiB,48GiB,56GiB}" 300 "$OUT/large.log" --tasks-limit 0 --repeats 5
  grep -h "GB/s\|floor" "$OUT/large.log" >>"$S" 2>/dev/null
}
job_p2p() {
  step "Dask p2p on CuPy chunks (no dask_pgas), as released" 200 "$OUT/p2p.log" python3 scripts/gpu/repro_p2p_cupy.py
  step "Dask p2p on CuPy chunks (no dask_pgas), _mean_shard_size patched" 200 "$OUT/p2p.log" \
    python3 scripts/gpu/repro_p2p_cupy.py --patched
  grep -h "^---\|^OK\|^FAILED\|^[A-Za-z]*Error" "$OUT/p2p.log" | head -40 >>"$S"
}
job_heap() {
  for np_ in 1 2; do
    step "heap probe np=$np_" 60 "$OUT/heap.log" env NVSHMEM_SYMMETRIC_SIZE=128m NVSHMEM_MAX_MEMORY_PER_GPU=2g \
      $MPIRUN -n $np_ python3 scripts/gpu/probe_heap_full.py
    # a fixed heap of NVSHMEM's default 1 GiB: nvshmem_malloc returns NULL when it is full (round 13d), and the
    # engine's limit is the size asked for
    echo "--- fixed heap (NVSHMEM_DISABLE_CUDA_VMM=1, NVSHMEM_SYMMETRIC_SIZE=1g), np=$np_" >>"$OUT/heap.log"
    step "heap probe, fixed 1 GiB heap, np=$np_" 60 "$OUT/heap.log" env NVSHMEM_SYMMETRIC_SIZE=1g \
      NVSHMEM_DISABLE_CUDA_VMM=1 $MPIRUN -n $np_ python3 scripts/gpu/probe_heap_full.py
  done
  grep -h "^HEAP\|^--- fixed" "$OUT/heap.log" >>"$S"
}
job_handle() {
  for case in unmade badmake onebad; do  # onebad: a FAIL(rc=124) is the answer (the valid rank stays inside Make)
    step "handle probe $case np=2" 40 "$OUT/handle.log" $MPIRUN -n 2 python3 scripts/gpu/probe_handle.py --case $case
  done
  grep -h "^HANDLE" "$OUT/handle.log" >>"$S"
}
job_deverror() {  # without MPS: under MPS one client's fault may take the other clients' contexts down too
  for np_ in 1 2 3; do
    step "device error on the last PE, np=$np_" 60 "$OUT/deverror.log" \
      $MPIRUN -n $np_ python3 tests/gpu/programs/device_error.py
  done
  echo "device error: $(grep -c '^OK rank=' "$OUT/deverror.log") of 6 ranks printed OK" >>"$S"
  grep -h "^CHECK.*FAIL\|^INFO DeviceError" "$OUT/deverror.log" | head -4 >>"$S"
}
job_exit() {  # nvmath's examples never call finalize() (nvmath finalizes at exit; dask_pgas does not)
  for case in freed held finalized; do
    step "exit without finalize: $case, np=2" 60 "$OUT/exit-$case.log" \
      $MPIRUN -n 2 python3 scripts/gpu/probe_exit.py --case $case
    echo "exit $case: $(grep -o 'EXITING.*' "$OUT/exit-$case.log" | tail -1); $(grep -v '^EXITING\|^===\|^ *$' "$OUT/exit-$case.log" | wc -l) other lines" >>"$S"
    grep -v '^EXITING\|^===\|^ *$' "$OUT/exit-$case.log" | head -3 >>"$S"
  done
}
job_daskcuda() {
  python3 -c "import dask_cuda, cuda.core; print('dask_cuda', dask_cuda.__version__, 'cuda.core', cuda.core.__version__)" >>"$S" 2>&1
  step "dask suite, 1 dask-cuda worker (LocalCUDACluster, default backends)" 200 "$OUT/daskcuda1.log" \
    env DASK_PGAS_TEST_GPU_WORKERS=1 DASK_PGAS_TEST_CLUSTER=dask-cuda \
    python3 -m pytest -q -p no:cacheprovider tests/dask/test_rechunk.py
  for size in 1GiB 8GiB; do
    step "examples/dask_cuda_rechunk.py --size $size" 120 "$OUT/daskcuda-example.log" \
      python3 examples/dask_cuda_rechunk.py --size $size
  done
  grep -h "passed\|failed" "$OUT"/daskcuda[0-9].log >>"$S" 2>/dev/null
  grep -h "World\|GB/s\|round trip\|Error" "$OUT/daskcuda-example.log" >>"$S" 2>/dev/null
}
job_bind() {
  step "GPU binding of 2 LocalMPICluster(gpus=1) and 2 LocalCluster workers" 120 "$OUT/bind.log" \
    python3 scripts/gpu/check_binding.py
  grep -h "^BIND\|Error" "$OUT/bind.log" >>"$S" 2>/dev/null
}

job_userenv() {
  local user=(env -u NVSHMEM_REMOTE_TRANSPORT -u NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME -u NVSHMEM_SYMMETRIC_SIZE
              -u NVSHMEM_DISABLE_NCCL NVSHMEM_DISABLE_NVLS=1)
  step "user env: main job (dask-pgas demo)" 120 "$OUT/userenv.log" "${user[@]}" python3 -m dask_pgas.cli demo
  step "user env: dask suite, 2 GPU workers outside MPI (unique-id bootstrap)" 200 "$OUT/userenv-local2.log" \
    "${user[@]}" DASK_PGAS_TEST_GPU_WORKERS=2 DASK_PGAS_TEST_CLUSTER=local \
    python3 -m pytest -q -p no:cacheprovider tests/dask/test_rechunk.py
  step "user env: examples/dask_cuda_rechunk.py --size 2GiB" 120 "$OUT/userenv.log" \
    "${user[@]}" python3 examples/dask_cuda_rechunk.py --size 2GiB
  step "user env: gpu_checks np=2" 100 "$OUT/userenv.log" "${user[@]}" $MPIRUN -n 2 python3 tests/gpu/programs/gpu_checks.py
  grep -h "passed\|failed" "$OUT/userenv-local2.log" >>"$S" 2>/dev/null
  grep -h "GB/s\|pgas vs\|round trip\|WRONG\|Error" "$OUT/userenv.log" | head -30 >>"$S" 2>/dev/null
}

# ---------------------------------------------------------------- main
cp .gpu-stage/part-* .gpu-stage/SHA256SUMS /tmp/stage/ 2>/dev/null
NOLIB=  # set by the upload calls: cuFFTMp is not all there yet, so only jobs that need no cuFFTMp may follow them
case "${1:-}" in
  upload)
    python3 scripts/gpu/install_wheels.py .whl /tmp/site >>"$S" 2>&1
    [ -d .gpu-old/dask_pgas ] && rm -rf /tmp/old && cp -r .gpu-old /tmp/old && echo "old package kept in /tmp/old" >>"$S"
    step "cpu planning tests" 90 "$OUT/upload.log" python3 -m pytest -q -p no:cacheprovider \
      tests/gpu/test_gpu_planning_cpu.py tests/gpu/test_gpu_engine_logic_cpu.py tests/unit tests/dask/test_chunks.py
    shift; NOLIB=1 ;;
  upload2)
    for np_ in 1 2 4; do
      rm -f /tmp/uid.bin
      step "uid bring-up, NVSHMEM only, np=$np_" 60 "$OUT/upload2.log" \
        $MPIRUN -n $np_ python3 tests/gpu/programs/uid_checks.py /tmp/uid.bin --no-reshape
    done
    shift; NOLIB=1 ;;
  "")
    echo "usage: final.sh upload [JOB...] | upload2 [JOB...] | JOB... (see the top of this file)" >&2; exit 2 ;;
esac
for job in "$@"; do
  declare -F "job_$job" >/dev/null || { echo "unknown job: $job (see the top of this file)" >&2; exit 2; }
  if [ -n "$NOLIB" ] && [[ " robust cpubench sbsuid cputimeline " != *" $job "* ]]; then
    echo "$job needs cuFFTMp: run it after the uploads (only robust, cpubench, sbsuid and cputimeline may follow upload/upload2)" >&2; exit 2
  fi
done
if [ -n "$NOLIB" ] && [ $# -eq 0 ]; then cat "$S"; pack_logs; exit 0; fi
if [ -z "$NOLIB" ] && [ ! -e /tmp/site/nvidia/cufftmp/cu13/lib/libcufftMp.so.12 ]; then
  (cd /tmp/stage && cat part-* > cufftmp-cu13-lib.tar.xz && sha256sum -c SHA256SUMS | sed 's/^/  /') >>"$S" 2>&1
  mkdir -p /tmp/site/nvidia/cufftmp/cu13 && xz -dc -T0 /tmp/stage/cufftmp-cu13-lib.tar.xz | tar -x -C /tmp/site/nvidia/cufftmp/cu13
  ln -sfn "$(python3 -c 'import nvidia.nvshmem, os; print(list(nvidia.nvshmem.__path__)[0])')" /tmp/site/nvidia/nvshmem
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$S"
python3 -c "import dask, distributed; from dask_pgas.engines.nvshmem import NVSHMEMEngine as E; print('dask', dask.__version__, 'unavailable_reason:', E.unavailable_reason())" >>"$S" 2>&1
for job in "$@"; do
  echo "--- $job" >>"$S"
  "job_$job"
done
echo "elapsed $(( $(date +%s) - START ))s" >>"$S"
cat "$S"
pack_logs
