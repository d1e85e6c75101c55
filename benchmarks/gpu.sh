#!/usr/bin/env bash
# The GPU measurements of docs/performance.md in one go, on a machine with one CUDA GPU and a CUDA build of
# torch (about 10 minutes on an H200). Runs from a source checkout without installing: PYTHONPATH=src.
# The corpus must be prepared already (data/prepared; the machine may have no network): copy it along.
#
#   bash benchmarks/gpu.sh [OUT_DIR]      (default: benchmarks/results)
#
# The GaLore peers are measured if importable (pip install 'lordo[bench]'), else reported and skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results}
mkdir -p "$out"
export PYTHONPATH=src PYTHONUNBUFFERED=1
lordo() { python3 -m lordo "$@"; }
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"

# the local optimizer step (CUDA events, medians): the paper's 16M shape and a 125M shape (d 768, 12 layers)
lordo bench step --device cuda --preset paper-16m --rounds 50 --compiled --json "$out/step-paper-16m-cuda.json"
lordo bench step --device cuda --d-model 768 --layers 12 --rank 96 --rounds 30 --compiled --json "$out/step-d768-cuda.json"
# basis refresh on real pseudo-gradients (captured by a short CPU run), timed on the GPU
lordo bench basis --device cuda --preset paper-16m --rank 32 --steps 32 --rounds 20 --json "$out/basis-paper-16m-cuda.json"
# end to end: tokens/s of lordo vs ddp, 4 simulated workers on the GPU, equal work
lordo bench runs --preset paper-16m --steps 64 --rank 32 --strategies ddp,lordo --repeats 2 \
  --set 'train.device="cuda"' --json "$out/runs-paper-16m-cuda.json"
# optimizer state measured from the tensors on the GPU, beside the allocator's growth over the run (the device
# share of every row: the bytes lordo counts against what torch.cuda.memory_allocated says it holds)
lordo bench memory --device cuda --shapes micro,paper-16m,d768x12 --json "$out/memory-cuda.json"
# what the lean state's 8-bit storage costs a training step on the GPU (on this project's CPU: 0.86x float32's
# tokens/s at paper-16m): float32 against --lean, round-robin
lordo bench throughput --preset paper-16m --steps 40 --warmup 10 --threads 1 --repeats 2 --settings fp32,lean \
  --set 'train.device="cuda"' --json "$out/throughput-paper-16m-cuda-lean.json"
