#!/usr/bin/env bash
# The LLaMA-2-7B rows issue 48 item 6 still lacks, as one call on a lent GPU machine (docs/gpu.md), from the
# repository root with .gpucheck/ carried (bitsandbytes; docs/gpu.md says how to build it):
#
#   bash bench/gpu_remaining_48.sh             # on the GPU: writes $OUT/log and two JSON files (9 min at most)
#   GPU_CHECK_DEVICE=--dry bash bench/gpu_remaining_48.sh   # a rehearsal of the same calls at tiny CPU shapes
#
# 1. The FRLoRA recipe's own 8-bit base (LLM.int8(), bf16 compute), FedAvg and FRLoRA, eager and under
#    train.compile: cudagraphs (a row that fails records its error; the other rows still run).
# 2. bf16 FedAvg, eager and cudagraphs, with every layer checkpointed and with every 2nd (less recompute): does eager
#    reach 40 % of the measured matmul peak, and what does each setting cost in memory?
set -o pipefail
export PYTHONPATH=$PWD/.gpucheck/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
out=${OUT:-$(mktemp -d)}
device=${GPU_CHECK_DEVICE:---device cuda}
quiet="Loading weights\|Writing model shards"
if [ "$device" = "--device cuda" ]; then
  (date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv
   python3 -c "import torch,transformers,peft,bitsandbytes as b;print('versions',torch.__version__,torch.version.cuda,transformers.__version__,peft.__version__,b.__version__)") 2>&1 | tee "$out/log"
fi
# shellcheck disable=SC2086  # $device is two words
timeout 300 python3 bench/gpu_check.py $device --paper-7b --configs 8bit --compile false,cudagraphs --steps 3 \
  --budget-s 240 --json "$out/paper7b_8bit.json" --work-dir "$out/work" 2>&1 | grep -v --line-buffered "$quiet" | tee -a "$out/log"
rm -rf "$out/work"
# shellcheck disable=SC2086
timeout 240 python3 bench/gpu_check.py $device --paper-7b --configs bf16 --strategies fedavg --compile false,cudagraphs \
  --checkpointing true,2 --steps 3 --budget-s 180 --json "$out/paper7b_bf16_checkpointing.json" --work-dir "$out/work" \
  2>&1 | grep -v --line-buffered "$quiet" | tee -a "$out/log"
rm -rf "$out/work"
echo "gpu_remaining_48: figures in $out"
