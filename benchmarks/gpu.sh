#!/usr/bin/env bash
# Every GPU benchmark in one command, on a machine with CUDA (NCCL, bf16):
#   1. bench_engines.py at three sizes (hf_zero 1-3, DDP, FSDP2, DeepSpeed 1-3; tokens/s, MFU
#      against --peak-tflops, model states, communication) and the scaling table;
#   2. bench_kernels.py (the Triton kernels: time and fraction of peak HBM bandwidth).
# Extra arguments go to bench_engines.py (e.g. --peak-tflops 989 --repeats 2 --compile inductor).
set -euo pipefail
cd "$(dirname "$0")"
python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "benchmarks/gpu.sh needs a CUDA device")'
python bench_engines.py --device cuda --sizes small,medium,smollm2 "$@"
python bench_kernels.py
