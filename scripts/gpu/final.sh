#!/usr/bin/env bash
# Whole GPU validation in 3 back-to-back device calls (engine + Dask on GPU workers), logs in $OUT:
#   1: carry [".gpu-stage/part-aa", ".gpu-stage/SHA256SUMS", ".whl"]   bash scripts/gpu/final.sh upload
#   2: carry [".gpu-stage/part-ab"]                                      bash scripts/gpu/final.sh upload
#   3: carry [".gpu-stage/part-ac"]                                      bash scripts/gpu/final.sh run
#      (or "rerun": only the 1- and 2-worker demos and the NumPy core suite)
# Session 3: s3-upload (part-aa + SHA256SUMS + .whl), upload2 (part-ab), s3-run (part-ac), s3-large (nothing);
#            second block: upload, upload2, s3b-run (part-ac); then s3c-run, s3d-run the same way.
# Session 4: upload, upload2, s4-run (part-ac); then s4-upload, upload2, s4-heap; then s4-upload,
#            upload2, s4-cap; after the review s4-upload, upload2, s4-review.
# Session 5: s5-upload (part-aa + SHA256SUMS + .whl), upload2 (part-ab), s5-run (part-ac); the same with s5-fail
#            and s5-mps.
# Session 6: s5-upload, upload2, s6-run (part-ac: MPS block, review commits); then s6-more (nothing carried:
#            the notebook on 1 and 2 GPU workers, the failure tests, 1 GPU worker); s5-upload, upload2, s6-nb.
# Session 7: s5-upload, upload2, s7-run (part-ac); then s7-p2p (.whl only); s5-upload, upload2, s7-peers;
#            s5-upload, upload2, s7-final.
# Session 8: s5-upload, upload2, s8-run (part-ac).
# Phase 1 runs correctness jobs side by side (they share the GPU); phase 2 runs the timed jobs one at a time.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/stage /tmp/site
export PYTHONUNBUFFERED=1 NVSHMEM_DISABLE_NVLS=1 NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo \
       NVSHMEM_SYMMETRIC_SIZE=8g NVSHMEM_DISABLE_NCCL=1 OMP_NUM_THREADS=1 \
       OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export PYTHONPATH=/tmp/site:$PWD
S=$OUT/summary.txt
START=$(date +%s); BUDGET=${BUDGET:-520}
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
# step NAME TIMEOUT LOG cmd...
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
# dask_suite K TIMEOUT LOG [local]: tests/dask/test_rechunk.py on K GPU workers (LocalMPICluster, or LocalCluster
# workers outside MPI with "local")
dask_suite() {
  local k=$1 to=$2 log=$3
  if [ "${4:-}" = local ]; then
    step "dask suite, $k GPU workers outside MPI (LocalCluster, unique-id bootstrap)" "$to" "$log" \
      env DASK_PGAS_TEST_GPU_WORKERS="$k" DASK_PGAS_TEST_CLUSTER=local python3 -m pytest -q -p no:cacheprovider tests/dask/test_rechunk.py
  else
    step "dask suite, $k GPU workers" "$to" "$log" \
      env DASK_PGAS_TEST_GPU_WORKERS="$k" python3 -m pytest -q -p no:cacheprovider tests/dask/test_rechunk.py
  fi
}
# failure_tests LOG: tests/dask/test_failure.py with 3 GPU workers (the kill test; the full-heap test makes 2)
failure_tests() {
  step "dask failure tests, 3 GPU workers (kill) and 2 (full heap)" 200 "$1" \
    env DASK_PGAS_TEST_GPU_WORKERS=3 python3 -m pytest -q -rA -p no:cacheprovider tests/dask/test_failure.py
}
# notebook K LOG: notebooks/01_pgas_rechunk.ipynb cell by cell on K GPU workers (1 GiB); its rates into the summary
notebook() {
  step "notebook, $1 GPU worker(s), 1 GiB" 150 "$2" \
    env DASK_PGAS_NOTEBOOK_WORKERS="$1" DASK_PGAS_NOTEBOOK_SIZE=1GiB python3 scripts/gpu/run_notebook.py notebooks/01_pgas_rechunk.ipynb
  grep -h "GB/s\|checked\|available\|PE \|Error" "$2" >>"$S" 2>/dev/null
}
# dask_block PREFIX [nofail]: the Dask suite on 2 and 4 GPU workers and on 2 outside MPI side by side, then
# failure_tests (left out with "nofail")
dask_block() {
  for k in 2 4; do
    dask_suite $k 200 "$OUT/$1-dask$k.log" &
  done
  dask_suite 2 200 "$OUT/$1-nanny2.log" local &
  wait
  [ "${2:-}" = nofail ] || failure_tests "$OUT/$1-failure.log"
}
# finish PREFIX: the test counts of PREFIX's logs and the elapsed time into the summary; print it and exit
finish() {
  grep -h "passed\|failed" "$OUT"/$1-*.log >>"$S" 2>/dev/null
  echo "elapsed $(( $(date +%s) - START ))s" >>"$S"; cat "$S"; exit 0
}
cp .gpu-stage/part-* .gpu-stage/SHA256SUMS /tmp/stage/ 2>/dev/null
if [ "${1:-run}" = upload ]; then
  ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/site .whl/*.whl
  ls /tmp/stage /tmp/site | tr '\n' ' ' >>"$S"; echo >>"$S"
  step "cpu planning tests" 90 "$OUT/upload.log" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_planning_cpu.py tests/unit tests/dask/test_chunks.py
  cat "$S"; exit 0
fi
if [ "${1:-run}" = upload2 ]; then  # NVSHMEM alone (no cuFFTMp yet): unique-id bring-up at 1, 2, 4 PEs
  for np_ in 1 2 4; do
    rm -f /tmp/uid.bin
    step "uid bring-up, NVSHMEM only, np=$np_" 60 "$OUT/upload2.log" mpirun --bind-to none -n $np_ python3 tests/gpu/programs/uid_checks.py /tmp/uid.bin --no-reshape
  done
  cat "$S"; exit 0
fi
if [ "${1:-run}" = s3-upload ]; then  # session 3, call 1 (part-aa + wheels): probes that need no cuFFTMp
  ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/site .whl/*.whl
  ls /tmp/stage | tr '\n' ' ' >>"$S"; echo >>"$S"
  for k in 1 2; do
    step "floor probe, $k workers, bound to a core" 60 "$OUT/floor.log" python3 scripts/gpu/probe_floor.py --workers $k --binding core
    step "floor probe, $k workers, unbound" 60 "$OUT/floor.log" python3 scripts/gpu/probe_floor.py --workers $k
  done
  for sz in 16GiB 32GiB; do
    step "local copy probe $sz" 60 "$OUT/localcopy.log" python3 scripts/gpu/probe_local_copy.py --size $sz
  done
  step "cpu planning tests" 90 "$OUT/upload.log" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_planning_cpu.py tests/unit tests/dask/test_chunks.py
  grep -h "^FLOOR\|^LOCALCOPY" "$OUT/floor.log" "$OUT/localcopy.log" >>"$S" 2>/dev/null
  echo "elapsed $(( $(date +%s) - START ))s" >>"$S"; cat "$S"; exit 0
fi
if [ "${1:-run}" = s4-upload ]; then  # session 4 (part-aa + SHA256SUMS + .whl): wheels, NVSHMEM's own variables
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  rm -f /tmp/uid.bin
  NVSHMEM_INFO=1 timeout 60 mpirun --bind-to none -n 1 python3 tests/gpu/programs/uid_checks.py /tmp/uid.bin --no-reshape >"$OUT/nvshmem-info.log" 2>&1
  grep -E "NVSHMEM_(SYMMETRIC_SIZE|MAX_MEMORY|DISABLE_CUDA_VMM|CUMEM)" -A1 "$OUT/nvshmem-info.log" >>"$S"
  cat "$S"; exit 0
fi
if [ "${1:-run}" = s5-upload ]; then  # session 5 (part-aa + SHA256SUMS + .whl): wheels, CPU-side tests there
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  step "cpu planning tests" 90 "$OUT/upload.log" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_planning_cpu.py tests/unit tests/dask/test_chunks.py
  cat "$S"; exit 0
fi
if [ ! -e /tmp/site/nvidia/cufftmp/cu13/lib/libcufftMp.so.12 ]; then
  (cd /tmp/stage && cat part-* > cufftmp-cu13-lib.tar.xz && sha256sum -c SHA256SUMS | sed 's/^/  /') >>"$S" 2>&1
  mkdir -p /tmp/site/nvidia/cufftmp/cu13 && xz -dc -T0 /tmp/stage/cufftmp-cu13-lib.tar.xz | tar -x -C /tmp/site/nvidia/cufftmp/cu13
  ln -sfn "$(python3 -c 'import nvidia.nvshmem, os; print(list(nvidia.nvshmem.__path__)[0])')" /tmp/site/nvidia/nvshmem
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$S"
python3 -c "import dask, distributed; from dask_pgas.engines.nvshmem import NVSHMEMEngine as E; print('dask', dask.__version__, 'unavailable_reason:', E.unavailable_reason())" >>"$S" 2>&1
MPIRUN="mpirun --bind-to none"
SUITE=tests/mpi/programs/reshape_suite.py
# core_suite NP PACKAGE EXAMPLES TIMEOUT LOG: the engine's random-layout suite against NumPy
core_suite() {
  step "core suite np=$1 $2" "$4" "$5" $MPIRUN -n "$1" python3 $SUITE --backend nvshmem --package "$2" --examples "$3"
}
# engine_benches TIMEOUT: issue 3's benchmark at 1, 2 and 4 PEs
engine_benches() {
  for np_ in 1 2 4; do
    step "bench np=$np_" "$1" "$OUT/bench.log" $MPIRUN -n $np_ python3 benchmarks/bench_gpu_reshape.py
  done
}
if [ "${1:-run}" = part1 ]; then  # correctness side by side, then the timed jobs one at a time
  step "pytest tests/gpu" 240 "$OUT/p1-pytest-gpu.log" python3 -m pytest -q -p no:cacheprovider tests/gpu &
  step "dask suite, 2 GPU workers" 240 "$OUT/p1-dask2.log" env DASK_PGAS_TEST_GPU_WORKERS=2 python3 -m pytest -q -p no:cacheprovider tests/dask/test_rechunk.py tests/dask/test_chunks.py &
  ( step "gpu_checks np=4" 100 "$OUT/p1-engine.log" $MPIRUN -n 4 python3 tests/gpu/programs/gpu_checks.py
    step "numpy suite np=4" 90 "$OUT/p1-engine.log" $MPIRUN -n 4 python3 $SUITE --backend nvshmem --package numpy --examples 10
    core_suite 1 cupy 12 60 "$OUT/p1-engine.log"
    core_suite 2 numpy 12 60 "$OUT/p1-engine.log"
    core_suite 4 torch 8 90 "$OUT/p1-engine.log" ) &
  wait
  engine_benches 60
  step "rechunk bench, 1 GPU worker" 220 "$OUT/rechunk1.log" python3 benchmarks/bench_rechunk_gpu.py --workers 1 --sizes 512MiB,4GiB,16GiB
  step "demo (main job), 1 GPU worker, 1GiB" 120 "$OUT/demo.log" python3 -m dask_pgas.cli demo --repeats 3
  grep -h "^BENCH" "$OUT/bench.log" >>"$S" 2>/dev/null
  grep -h "passed\|failed\|error" "$OUT"/p1-dask2.log "$OUT"/p1-pytest-gpu.log | tail -4 >>"$S" 2>/dev/null
  echo "elapsed $(( $(date +%s) - START ))s" >>"$S"; cat "$S"; exit 0
fi
if [ "${1:-run}" = part3 ]; then
  for k in 1 2 4; do
    step "dask suite, $k GPU workers" 240 "$OUT/p3-dask$k.log" env DASK_PGAS_TEST_GPU_WORKERS=$k python3 -m pytest -q -p no:cacheprovider tests/dask/test_rechunk.py &
  done
  wait
  step "rechunk bench, 1 GPU worker" 200 "$OUT/rechunk1.log" python3 benchmarks/bench_rechunk_gpu.py --workers 1 --sizes 512MiB,4GiB,16GiB,32GiB
  step "demo (main job), 1 GPU worker, 1GiB" 100 "$OUT/demo.log" python3 -m dask_pgas.cli demo --repeats 3
  step "rechunk bench, 2 GPU workers" 120 "$OUT/rechunk2.log" python3 benchmarks/bench_rechunk_gpu.py --workers 2 --sizes 512MiB,2GiB
  grep -h "passed\|failed" "$OUT"/p3-*.log >>"$S" 2>/dev/null
  echo "elapsed $(( $(date +%s) - START ))s" >>"$S"; cat "$S"; exit 0
fi
if [ "${1:-run}" = part4 ]; then  # third block: after the GPU memory-limit and orphan fixes
  step "dask suite, 1 GPU worker" 150 "$OUT/p4-dask1.log" env DASK_PGAS_TEST_GPU_WORKERS=1 python3 -m pytest -q -p no:cacheprovider tests/dask/test_rechunk.py
  step "rechunk bench, 1 GPU worker" 200 "$OUT/rechunk1.log" python3 benchmarks/bench_rechunk_gpu.py --workers 1 --sizes 512MiB,4GiB,16GiB,32GiB
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader >>"$S"
  step "demo (main job), 1 GPU worker, 1GiB" 100 "$OUT/demo.log" python3 -m dask_pgas.cli demo --repeats 3
  step "rechunk bench, 2 GPU workers" 120 "$OUT/rechunk2.log" python3 benchmarks/bench_rechunk_gpu.py --workers 2 --sizes 512MiB,2GiB
  grep -h "passed\|failed" "$OUT"/p4-*.log >>"$S" 2>/dev/null
  echo "elapsed $(( $(date +%s) - START ))s" >>"$S"; cat "$S"; exit 0
fi
if [ "${1:-run}" = part5 ]; then  # last block: output tasks overlap the collective; no size exchange; large sizes
  for k in 1 2 4; do
    step "dask suite, $k GPU workers" 150 "$OUT/p5-dask$k.log" env DASK_PGAS_TEST_GPU_WORKERS=$k python3 -m pytest -q -p no:cacheprovider tests/dask/test_rechunk.py &
  done
  wait
  step "rechunk bench, 2 GPU workers" 90 "$OUT/rechunk2.log" python3 benchmarks/bench_rechunk_gpu.py --workers 2 --sizes 512MiB,2GiB --tasks-limit 0
  engine_benches 40
  mps_start
  for np_ in 2 4; do
    export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / np_))
    step "MPS bench np=$np_" 40 "$OUT/mps-bench.log" $MPIRUN -n $np_ python3 benchmarks/bench_gpu_reshape.py
  done
  mps_stop
  step "rechunk bench, 1 GPU worker, large" 150 "$OUT/rechunk1.log" python3 benchmarks/bench_rechunk_gpu.py --workers 1 --sizes 32GiB,48GiB --tasks-limit 0 --repeats 3
  grep -h "passed\|failed" "$OUT"/p5-dask*.log >>"$S" 2>/dev/null
  grep -h "^BENCH" "$OUT/bench.log" "$OUT/mps-bench.log" >>"$S" 2>/dev/null
  grep -h "GB/s\|floor" "$OUT/rechunk2.log" "$OUT/rechunk1.log" >>"$S" 2>/dev/null
  echo "elapsed $(( $(date +%s) - START ))s" >>"$S"; cat "$S"; exit 0
fi
if [ "${1:-run}" = s3-run ]; then  # session 3, call 3 (part-ac): correctness side by side, then engine benches
  for k in 1 2 4; do
    dask_suite $k 240 "$OUT/s3-dask$k.log" &
  done
  step "pytest tests/gpu" 240 "$OUT/s3-pytest-gpu.log" python3 -m pytest -q -p no:cacheprovider tests/gpu &
  ( for np_ in 1 2 4; do
      step "gpu_checks np=$np_" 100 "$OUT/s3-engine.log" $MPIRUN -n $np_ python3 tests/gpu/programs/gpu_checks.py
    done
    core_suite 3 cupy 10 90 "$OUT/s3-engine.log"
    core_suite 2 numpy 10 90 "$OUT/s3-engine.log"
    core_suite 4 torch 8 90 "$OUT/s3-engine.log" ) &
  wait
  engine_benches 40
  step "rechunk bench, 2 GPU workers" 100 "$OUT/rechunk2.log" python3 benchmarks/bench_rechunk_gpu.py --workers 2 --sizes 512MiB,2GiB --tasks-limit 0
  step "rechunk bench, 1 GPU worker" 120 "$OUT/rechunk1.log" python3 benchmarks/bench_rechunk_gpu.py --workers 1 --sizes 512MiB,4GiB,16GiB --tasks-limit 0
  grep -h "passed\|failed" "$OUT"/s3-dask*.log "$OUT"/s3-pytest-gpu.log >>"$S" 2>/dev/null
  grep -h "^BENCH" "$OUT/bench.log" >>"$S" 2>/dev/null
  grep -h "GB/s\|floor" "$OUT/rechunk2.log" "$OUT/rechunk1.log" >>"$S" 2>/dev/null
  echo "elapsed $(( $(date +%s) - START ))s" >>"$S"; cat "$S"; exit 0
fi
if [ "${1:-run}" = s3-large ]; then  # session 3, call 4: one worker at large sizes, the failure test, the demo
  step "rechunk bench, 1 GPU worker, large" 300 "$OUT/rechunk1-large.log" python3 benchmarks/bench_rechunk_gpu.py --workers 1 --sizes 32GiB,48GiB,56GiB --tasks-limit 0 --repeats 5
  step "dask failure test, 3 GPU workers" 150 "$OUT/s3-failure.log" env DASK_PGAS_TEST_GPU_WORKERS=3 python3 -m pytest -q -rA -p no:cacheprovider tests/dask/test_failure.py
  step "demo (main job), 1 GPU worker, 1GiB" 100 "$OUT/demo.log" python3 -m dask_pgas.cli demo --repeats 3
  grep -h "GB/s\|floor" "$OUT/rechunk1-large.log" >>"$S" 2>/dev/null
  grep -h "passed\|failed" "$OUT/s3-failure.log" >>"$S" 2>/dev/null
  grep -h "GB/s\|pgas vs\|copy" "$OUT/demo.log" >>"$S" 2>/dev/null
  echo "elapsed $(( $(date +%s) - START ))s" >>"$S"; cat "$S"; exit 0
fi
if [ "${1:-run}" = s3b-run ]; then  # session 3, second block (after upload, upload2): workers outside MPI, binding
  step "pytest tests/gpu" 200 "$OUT/s3b-pytest-gpu.log" python3 -m pytest -q -p no:cacheprovider tests/gpu &
  for k in 2 3; do
    dask_suite $k 240 "$OUT/s3b-nanny$k.log" local &
  done
  wait
  step "rechunk bench, 1 GPU worker bound to a core" 150 "$OUT/s3b-bound.log" env OMPI_MCA_hwloc_base_binding_policy=core python3 benchmarks/bench_rechunk_gpu.py --workers 1 --sizes 4GiB,32GiB --tasks-limit 0 --heap-limit 0
  step "rechunk bench, 1 GPU worker unbound" 150 "$OUT/s3b-unbound.log" python3 benchmarks/bench_rechunk_gpu.py --workers 1 --sizes 4GiB,32GiB --tasks-limit 0 --heap-limit 0
  grep -h "passed\|failed" "$OUT"/s3b-*.log >>"$S" 2>/dev/null
  grep -h "GB/s\|floor" "$OUT/s3b-bound.log" "$OUT/s3b-unbound.log" >>"$S" 2>/dev/null
  echo "elapsed $(( $(date +%s) - START ))s" >>"$S"; cat "$S"; exit 0
fi
if [ "${1:-run}" = s3c-run ]; then  # session 3, third block (after upload, upload2): workers outside MPI, large sizes
  for k in 2 3; do
    dask_suite $k 200 "$OUT/s3c-nanny$k.log" local &
  done
  wait
  step "rechunk bench, 1 GPU worker, large" 240 "$OUT/s3c-large.log" python3 benchmarks/bench_rechunk_gpu.py --workers 1 --sizes 32GiB,48GiB --tasks-limit 0 --heap-limit 0 --repeats 7
  grep -h "passed\|failed" "$OUT"/s3c-nanny*.log >>"$S" 2>/dev/null
  grep -h "GB/s\|floor" "$OUT/s3c-large.log" >>"$S" 2>/dev/null
  echo "elapsed $(( $(date +%s) - START ))s" >>"$S"; cat "$S"; exit 0
fi
if [ "${1:-run}" = s3d-run ]; then  # session 3, last block (after upload, upload2): the Dask suites on the final tree
  dask_block s3d
  finish s3d
fi
if [ "${1:-run}" = s3e-run ]; then  # session 3, after the review (after upload, upload2): the engine's bring-up
  for np_ in 1 2 4; do
    step "gpu_checks np=$np_" 60 "$OUT/s3e-engine.log" $MPIRUN -n $np_ python3 tests/gpu/programs/gpu_checks.py
  done
  rm -f /tmp/uid.bin
  step "uid bring-up with reshape np=2" 40 "$OUT/s3e-engine.log" $MPIRUN -n 2 python3 tests/gpu/programs/uid_checks.py /tmp/uid.bin
  echo "elapsed $(( $(date +%s) - START ))s" >>"$S"; cat "$S"; exit 0
fi
if [ "${1:-run}" = s4-heap ]; then  # session 4 (part-ac, after s4-upload and upload2): the failure tests again
  failure_tests "$OUT/s4-failure.log"
  finish s4
fi
if [ "${1:-run}" = s4-cap ]; then  # session 4 (part-ac, after s4-upload and upload2): the engine's heap cap
  for np_ in 1 2; do
    step "heap probe np=$np_" 60 "$OUT/s4-heap.log" env NVSHMEM_SYMMETRIC_SIZE=128m NVSHMEM_MAX_MEMORY_PER_GPU=2g $MPIRUN -n $np_ python3 scripts/gpu/probe_heap_full.py
  done
  failure_tests "$OUT/s4-failure.log"
  step "gpu_checks np=2" 60 "$OUT/s4-engine.log" $MPIRUN -n 2 python3 tests/gpu/programs/gpu_checks.py
  core_suite 2 cupy 12 60 "$OUT/s4-engine.log"
  dask_suite 2 150 "$OUT/s4-dask2.log"
  grep -h "^HEAP" "$OUT/s4-heap.log" >>"$S"
  finish s4
fi
if [ "${1:-run}" = s4-review ]; then  # session 4, after the review (part-ac, after s4-upload and upload2)
  for np_ in 1 2 4; do
    step "gpu_checks np=$np_ (traced)" 60 "$OUT/s4r-engine.log" env DASK_PGAS_NVSHMEM_TRACE=1 $MPIRUN -n $np_ python3 tests/gpu/programs/gpu_checks.py
  done
  echo "cuFFTMp plans by workspace size: $(grep -o 'plan workspace=[0-9]*' "$OUT/s4r-engine.log" | sort | uniq -c | tr '\n' ' ')" >>"$S"
  failure_tests "$OUT/s4r-failure.log"
  dask_suite 2 150 "$OUT/s4r-dask2.log"
  finish s4r
fi
if [ "${1:-run}" = s5-run ]; then  # session 5 (part-ac, after s5-upload and upload2): the device-memory check
  failure_tests "$OUT/s5-failure.log"  # alone: the full-GPU test fills the GPU
  ( for np_ in 1 2; do
      step "gpu_checks np=$np_" 60 "$OUT/s5-engine.log" $MPIRUN -n $np_ python3 tests/gpu/programs/gpu_checks.py
    done
    core_suite 2 cupy 12 60 "$OUT/s5-engine.log" ) &
  dask_suite 2 150 "$OUT/s5-dask2.log" &
  wait
  step "rechunk bench, 1 GPU worker" 150 "$OUT/s5-rechunk1.log" python3 benchmarks/bench_rechunk_gpu.py --workers 1 --sizes 512MiB,4GiB,32GiB --tasks-limit 0
  grep -h "GB/s\|floor" "$OUT/s5-rechunk1.log" >>"$S" 2>/dev/null
  finish s5
fi
if [ "${1:-run}" = s5-fail ]; then  # session 5, again (part-ac): the failure tests, then 1 and 4 GPU workers
  failure_tests "$OUT/s5f-failure.log"
  for k in 1 4; do
    dask_suite $k 150 "$OUT/s5f-dask$k.log" &
  done
  wait
  finish s5f
fi
if [ "${1:-run}" = s5-mps ] || [ "${1:-run}" = s6-run ]; then  # (part-ac) the engine and the Dask suite under MPS
  P=${1%-*}m  # log prefix: s5m or s6m
  mps_start
  export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50
  step "gpu_checks np=2 (MPS)" 60 "$OUT/$P-engine.log" $MPIRUN -n 2 python3 tests/gpu/programs/gpu_checks.py
  core_suite 2 cupy 12 60 "$OUT/$P-engine.log"
  dask_suite 2 150 "$OUT/$P-dask2.log"
  export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25
  step "gpu_checks np=4 (MPS)" 60 "$OUT/$P-engine.log" $MPIRUN -n 4 python3 tests/gpu/programs/gpu_checks.py
  dask_suite 4 150 "$OUT/$P-dask4.log"
  mps_stop
  finish $P
fi
if [ "${1:-run}" = s6-more ]; then  # session 6 (machine still warm): the notebook on GPU workers, failures, 1 PE
  for k in 1 2; do
    notebook $k "$OUT/s6-notebook$k.log"
  done
  step "gpu_checks np=1" 60 "$OUT/s6-engine.log" $MPIRUN -n 1 python3 tests/gpu/programs/gpu_checks.py
  failure_tests "$OUT/s6-failure.log"
  dask_suite 1 150 "$OUT/s6-dask1.log"
  finish s6
fi
if [ "${1:-run}" = s6-nb ]; then  # session 6 (part-ac): the notebook as committed (warm timings) on 1, 2, 4 workers
  for k in 1 2 4; do
    notebook $k "$OUT/s6n-notebook$k.log"
  done
  step "main job (dask-pgas demo, embedded default: one worker per GPU)" 120 "$OUT/s6n-demo.log" python3 -m dask_pgas.cli demo
  grep -h "GB/s\|pgas vs\|copy\|WRONG" "$OUT/s6n-demo.log" >>"$S" 2>/dev/null
  failure_tests "$OUT/s6n-failure.log"
  finish s6n
fi
if [ "${1:-run}" = s6-peers ]; then  # session 6 (part-ac): pgas beside tasks and p2p on 2 and 4 GPU workers
  step "rechunk bench, 2 GPU workers" 200 "$OUT/s6p-rechunk2.log" python3 benchmarks/bench_rechunk_gpu.py --workers 2 --sizes 1GiB,4GiB --repeats 3
  step "rechunk bench, 4 GPU workers" 150 "$OUT/s6p-rechunk4.log" python3 benchmarks/bench_rechunk_gpu.py --workers 4 --sizes 1GiB --repeats 3
  grep -h "GB/s\|floor\|Error\|worker" "$OUT"/s6p-rechunk*.log >>"$S" 2>/dev/null
  finish s6p
fi
if [ "${1:-run}" = s7-run ]; then  # session 7 (part-ac): the notebook after the timer fix; Dask p2p on CuPy alone
  for k in 1 2; do
    notebook $k "$OUT/s7-notebook$k.log"
  done
  step "Dask p2p rechunk of CuPy chunks, minimal reproduction (no dask_pgas)" 200 "$OUT/s7-p2p-repro.log" \
    python3 scripts/gpu/repro_p2p_cupy.py
  grep -h "^---\|^OK\|^FAILED\|^[A-Za-z]*Error" "$OUT/s7-p2p-repro.log" | head -40 >>"$S"
  finish s7
fi
if [ "${1:-run}" = s7-p2p ]; then  # session 7 (.whl only, no cuFFTMp needed): p2p on CuPy with the candidate fix
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  step "Dask p2p rechunk of CuPy chunks, _mean_shard_size patched on the workers" 200 "$OUT/s7-p2p-patched.log" \
    python3 scripts/gpu/repro_p2p_cupy.py --patched
  grep -h "^---\|^OK\|^FAILED\|^[A-Za-z]*Error" "$OUT/s7-p2p-patched.log" | head -40 >>"$S"
  finish s7
fi
if [ "${1:-run}" = s7-peers ]; then  # session 7 (part-ac): pgas beside tasks and p2p with the CuPy fix, 1/2/4 workers
  step "rechunk bench, 1 GPU worker, p2p+fix" 150 "$OUT/s7p-rechunk1.log" python3 benchmarks/bench_rechunk_gpu.py --workers 1 --sizes 1GiB,4GiB --repeats 3 --p2p-cupy-fix
  step "rechunk bench, 2 GPU workers, p2p+fix" 200 "$OUT/s7p-rechunk2.log" python3 benchmarks/bench_rechunk_gpu.py --workers 2 --sizes 1GiB,4GiB --repeats 3 --p2p-cupy-fix
  step "rechunk bench, 4 GPU workers, p2p+fix" 150 "$OUT/s7p-rechunk4.log" python3 benchmarks/bench_rechunk_gpu.py --workers 4 --sizes 1GiB --repeats 3 --p2p-cupy-fix
  grep -h "GB/s\|floor\|Error\|worker" "$OUT"/s7p-rechunk*.log >>"$S" 2>/dev/null
  finish s7p
fi
if [ "${1:-run}" = s7-final ]; then  # session 7 (part-ac): the final tree (planner byte cost), multi-worker plans
  dask_block s7f nofail
  finish s7f
fi
if [ "${1:-run}" = s7-cancel ]; then  # session 7 (part-ac): s7-final's one failure, again on 4 GPU workers
  dask_suite 4 150 "$OUT/s7c-dask4.log"
  for i in 1 2 3; do
    step "cancel test, 4 GPU workers, try $i" 60 "$OUT/s7c-cancel.log" \
      env DASK_PGAS_TEST_GPU_WORKERS=4 python3 -m pytest -q -p no:cacheprovider tests/dask/test_rechunk.py -k cancelled
  done
  finish s7c
fi
if [ "${1:-run}" = s8-run ]; then  # session 8 (part-ac): runs cancelled inside their collective; Dask suites
  dask_block s8 nofail
  for i in 1 2 3 4 5; do
    step "cancel tests, 4 GPU workers, try $i" 60 "$OUT/s8-cancel.log" \
      env DASK_PGAS_TEST_GPU_WORKERS=4 python3 -m pytest -q -p no:cacheprovider tests/dask/test_rechunk.py -k cancelled
  done
  failure_tests "$OUT/s8-failure.log"
  finish s8
fi
if [ "${1:-run}" = s4-run ]; then  # session 4 (after upload, upload2): Dask suites on the final tree, full-heap test
  dask_block s4
  step "dask suite, 1 GPU worker" 150 "$OUT/s4-dask1.log" env DASK_PGAS_TEST_GPU_WORKERS=1 python3 -m pytest -q -p no:cacheprovider tests/dask/test_rechunk.py
  finish s4
fi
if [ "${1:-run}" = part2 ]; then  # Dask on 1/4 GPU workers, 2-worker rechunk bench, MPS block, failure test
  step "rechunk bench, 2 GPU workers" 120 "$OUT/rechunk2.log" python3 benchmarks/bench_rechunk_gpu.py --workers 2 --sizes 512MiB,2GiB
  step "dask suite, 1 GPU worker" 200 "$OUT/p2-dask1.log" env DASK_PGAS_TEST_GPU_WORKERS=1 python3 -m pytest -q -p no:cacheprovider tests/dask/test_rechunk.py &
  step "dask suite, 4 GPU workers" 240 "$OUT/p2-dask4.log" env DASK_PGAS_TEST_GPU_WORKERS=4 python3 -m pytest -q -p no:cacheprovider tests/dask/test_rechunk.py &
  wait
  mps_start
  for np_ in 2 4; do
    export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / np_))
    for pkg in cupy torch numpy; do
      step "MPS core suite np=$np_ $pkg" 60 "$OUT/mps.log" $MPIRUN -n $np_ python3 $SUITE --backend nvshmem --package $pkg --examples 8
    done
    step "MPS gpu_checks np=$np_" 80 "$OUT/mps.log" $MPIRUN -n $np_ python3 tests/gpu/programs/gpu_checks.py
    step "MPS bench np=$np_" 50 "$OUT/mps-bench.log" $MPIRUN -n $np_ python3 benchmarks/bench_gpu_reshape.py
  done
  mps_stop
  step "dask failure test, 3 GPU workers" 150 "$OUT/p2-failure.log" env DASK_PGAS_TEST_GPU_WORKERS=3 python3 -m pytest -q -rA -p no:cacheprovider tests/dask/test_failure.py
  grep -h "^BENCH" "$OUT/mps-bench.log" >>"$S" 2>/dev/null
  grep -h "passed\|failed" "$OUT"/p2-*.log >>"$S" 2>/dev/null
  echo "elapsed $(( $(date +%s) - START ))s" >>"$S"; cat "$S"; exit 0
fi
if [ "${1:-run}" = rerun ]; then  # the short second round: the 1-worker demo and the NumPy suite
  step "demo 1 GPU worker, S1 512MiB" 110 "$OUT/demo1.log" python3 -m dask_pgas.cli demo --size 512MiB --workers 1 --repeats 3
  step "numpy suite np=2 (trace)" 50 "$OUT/numpy.log" env DASK_PGAS_TEST_DUMP_AFTER=40 $MPIRUN -n 2 python3 tests/mpi/programs/reshape_suite.py --backend nvshmem --package numpy --examples 15
  step "demo 2 GPU workers (one GPU)" 100 "$OUT/demo2.log" python3 -m dask_pgas.cli demo --size 512MiB --workers 2 --repeats 3
  grep -h "GB/s\|pgas vs\|copy\|WRONG" "$OUT"/demo*.log >>"$S" 2>/dev/null
  tail -3 "$OUT/numpy.log" >>"$S"
  echo "elapsed $(( $(date +%s) - START ))s" >>"$S"; cat "$S"; exit 0
fi
SUITE=tests/mpi/programs/reshape_suite.py
# ---- phase 1: correctness, side by side
step "dask suite, 2 GPU workers" 200 "$OUT/dask2.log" env DASK_PGAS_TEST_GPU_WORKERS=2 python3 -m pytest -q -p no:cacheprovider -x tests/dask/test_rechunk.py &
step "numpy suite np=2 (trace)" 70 "$OUT/numpy.log" env DASK_PGAS_NVSHMEM_TRACE=1 DASK_PGAS_TEST_DUMP_AFTER=55 $MPIRUN -n 2 python3 $SUITE --backend nvshmem --package numpy --examples 15 &
( step "gpu_checks np=2" 100 "$OUT/engine.log" $MPIRUN -n 2 python3 tests/gpu/programs/gpu_checks.py
  core_suite 2 cupy 12 100 "$OUT/engine.log"
  core_suite 2 torch 12 100 "$OUT/engine.log"
  core_suite 3 cupy 8 100 "$OUT/engine.log" ) &
wait
# ---- phase 2: timed, one at a time
step "demo 1 GPU worker, S1 512MiB" 150 "$OUT/demo1.log" python3 -m dask_pgas.cli demo --size 512MiB --workers 1 --repeats 3
step "bench np=1" 60 "$OUT/bench.log" $MPIRUN -n 1 python3 benchmarks/bench_gpu_reshape.py
step "bench np=2" 60 "$OUT/bench.log" $MPIRUN -n 2 python3 benchmarks/bench_gpu_reshape.py
step "demo 2 GPU workers (one GPU), pgas only" 90 "$OUT/demo2.log" python3 -m dask_pgas.cli demo --size 512MiB --workers 2 --repeats 3 --pgas-only
step "dask suite, 1 GPU worker" 150 "$OUT/dask1.log" env DASK_PGAS_TEST_GPU_WORKERS=1 python3 -m pytest -q -p no:cacheprovider -x tests/dask/test_rechunk.py
grep -h "GB/s\|pgas vs\|copy" "$OUT"/demo*.log >>"$S" 2>/dev/null
grep -h "^BENCH\|GB/s" "$OUT/bench.log" >>"$S" 2>/dev/null
grep -h "passed\|failed" "$OUT"/dask*.log >>"$S" 2>/dev/null
echo "elapsed $(( $(date +%s) - START ))s" >>"$S"
cat "$S"
