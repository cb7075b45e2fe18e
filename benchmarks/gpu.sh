#!/usr/bin/env bash
# Every GPU benchmark in one command, on a machine with CUDA (NCCL, bf16). Each section can also
# be run on its own: copy its command.
#   engines     bench_engines.py at three sizes (hf_zero 1-3, DDP, FSDP2, DeepSpeed 1-3; tokens/s, MFU
#               against --peak-tflops, model states, communication) and the scaling table;
#   kernels     (a) bench_kernels.py: hf_zero's fused Adam against torch.optim.AdamW(fused=True), GB/s
#               and fraction of the card's peak HBM bandwidth (the roofline: 28-30 bytes per parameter);
#   fake_world  (b) bench_one_gpu.py: a stage-3 step of a 1.1B Llama as rank 5 and rank 0 of a fake
#               world of 8, against the same model's compute-only step (what the execution layer costs);
#   largest     (c) bench_one_gpu.py --largest: the largest Llama (7B, 3B, 1.1B tried in that order)
#               that trains on this GPU with offload_optimizer cpu, its tokens/s and its ratio to the
#               compute-only step (a 7B needs ~14 GB of GPU and ~112 GB of host memory).
#   suite       (not in the default list) the CUDA test suite, from the repository root.
# Usage: benchmarks/gpu.sh [SECTION ...] [-- extra bench_engines.py arguments]
#   benchmarks/gpu.sh                       # all four benchmarks
#   benchmarks/gpu.sh suite kernels fake_world engines -- --sizes small,medium --engines hf_zero,torch
#                                           # the suite and three benchmarks in about 6 minutes on an H200
#   benchmarks/gpu.sh kernels fake_world    # (a) and (b) only
#   benchmarks/gpu.sh engines -- --peak-tflops 989 --repeats 2 --compile inductor
# It runs from a checkout without an install (a GPU image with its own torch): hf_zero comes from
# src/, and compat/ makes torch's fake process group behave as in 2.13 on an older torch.
set -uo pipefail
cd "$(dirname "$0")"
repo=$(dirname "$PWD")
export PYTHONPATH="$PWD/compat:$repo/src:$repo${PYTHONPATH:+:$PYTHONPATH}"
python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "benchmarks/gpu.sh needs a CUDA device")' || exit 1

sections=()
while [[ $# -gt 0 && "$1" != "--" ]]; do sections+=("$1"); shift; done
[[ "${1:-}" == "--" ]] && shift
[[ ${#sections[@]} -eq 0 ]] && sections=(engines kernels fake_world largest)

# Peak HBM bandwidth of this card in GB/s (datasheet figures), for the kernels' roofline column.
peak_gbps=$(python - <<'EOF'
import torch
name = torch.cuda.get_device_name()
peaks = [("H200", 4800), ("H100 NVL", 3900), ("H100 PCIe", 2000), ("H100", 3350), ("A100-SXM4-80GB", 2039),
         ("A100 80GB PCIe", 1935), ("A100", 1555), ("L40S", 864), ("L4", 300)]
print(next((gbps for key, gbps in peaks if key in name), 3350))
EOF
)

failed=()
run() {  # run SECTION COMMAND...: a failing section is reported at the end; the others still run
    local section=$1; shift
    echo "== $section: $*"
    "$@" || failed+=("$section")
}
for section in "${sections[@]}"; do
    case "$section" in
        engines) run engines python bench_engines.py --device cuda --sizes small,medium,smollm2 "$@" ;;
        kernels) run kernels python bench_kernels.py --sizes 16M,128M,512M --peak-gbps "$peak_gbps" ;;
        fake_world)
            run fake_world_rank5 python bench_one_gpu.py --model llama-1b --world 8 --rank 5
            run fake_world_rank0 python bench_one_gpu.py --model llama-1b --world 8 --rank 0 ;;
        suite) suite_files=$(cd "$repo" && python -c 'from tests.cuda_suite import CUDA_SUITE_FILES; print(*CUDA_SUITE_FILES)')
               cd "$repo"; run suite python -m pytest -q $suite_files; cd "$repo/benchmarks" ;;
        largest) run largest python bench_one_gpu.py --model llama-7b,llama-3b,llama-1b --largest --world 1 \
                     --offload-optimizer cpu --steps 5 --warmup 2 ;;
        *) echo "unknown section $section (suite, engines, kernels, fake_world, largest)"; failed+=("$section") ;;
    esac
done
if [[ ${#failed[@]} -gt 0 ]]; then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
