#!/usr/bin/env bash
# Sweeps run on one CUDA GPU, six points at a time (six 2,000-step micro points take under 5 minutes on an
# H200). Each sweep file is copied with train.device = "cuda" added to its base and run into OUT/<name>;
# finished points are skipped on a rerun, as with lordo sweep. Runs from a source checkout: PYTHONPATH=src;
# the corpus must be prepared already (data/prepared: carry it along).
#
#   bash benchmarks/gpu-sweeps.sh OUT_DIR sweeps/fidelity-rank.toml [more.toml ...]
#
# GPU arithmetic is not the CPU's bit for bit: compare the points of one machine with each other.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$1; shift
mkdir -p "$out"
export PYTHONPATH=src PYTHONUNBUFFERED=1
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"
for file in "$@"; do
  name=$(basename "$file" .toml)
  copy="$out/$name.cuda.toml"
  python3 - "$file" "$copy" <<'PY'
import sys, tomllib
src, dst = sys.argv[1], sys.argv[2]
text = open(src, encoding="utf-8").read()
data = tomllib.loads(text)
if "device" in data.get("base", {}).get("train", {}):
    raise SystemExit(f"{src}: base.train.device is set already")
if "[base.train]" not in text:
    raise SystemExit(f"{src}: no [base.train] table to add train.device to")
open(dst, "w", encoding="utf-8").write(text.replace("[base.train]\n", '[base.train]\ndevice = "cuda"\n', 1))
PY
  python3 -m lordo sweep "$copy" --jobs 6 --out "$out/$name"
done
