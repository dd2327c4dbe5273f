#!/usr/bin/env bash
# The GPU checks, as one run on a lent CUDA machine (about 6 minutes; its python3 holds torch and
# pytest, no vLLM): the tests marked gpu, benchmarks/gpu_bench.py, and benchmarks/scale.py --quick with
# every tensor on the GPU. Logs, JSON and PNGs (8 files) go to $OUT (the device tool's) or gpu_out/.
# Exit status: the tests'. It ran on CPU with torch 2.11 (the device image's), every part skipping.
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${OUT:-gpu_out}")
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
# test_comm's NCCL parties share the one GPU (NCCL >= 2.30 allows it with this; older NCCL refuses)
export NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_NVLS_ENABLE=0
{ nvidia-smi -L; $py -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'; } \
    2>&1 | tee "$out/device.txt"
timeout 180 $py -m pytest -q -p no:cacheprovider -m gpu tests/test_comm.py tests/test_ipc.py tests/test_buckets.py tests/test_nixl_plane.py \
    2>&1 | tee "$out/gpu_tests.log"
rc=$?
timeout 180 $py benchmarks/gpu_bench.py --out "$out" 2>&1 | tee "$out/gpu_bench.log"
timeout 120 $py benchmarks/scale.py --quick --device cuda --out "$out/scale_cuda.json" \
    --png "$out/scale_cuda.png" 2>&1 | tee "$out/scale_cuda.log"
exit "$rc"
