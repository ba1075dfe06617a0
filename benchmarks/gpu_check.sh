#!/usr/bin/env bash
# The GPU checks of the cost model, as one command for a machine with CUDA GPUs:
#
#   bash benchmarks/gpu_check.sh OUTDIR
#
# from the repository root. It installs autopar without its dependencies into
# a scratch folder (torch with CUDA must be there; ortools too, or carried as
# wheels on PYTHONPATH), then
#   1. autopar calibrate on every GPU of the machine (NCCL; with one GPU the
#      links come from the GPU's preset) -> OUTDIR/gpu-profile.json;
#   2. benchmarks/kernel_times.py against the GPU's preset, written into
#      docs/validation.md as its section 3 -> OUTDIR/validation.md and
#      OUTDIR/kernel_times_preset.md;
#   3. the same kernels against the profile just calibrated
#      -> OUTDIR/kernel_times_profile.md.
# Copy OUTDIR/validation.md over docs/validation.md to keep the section.
#
# On this workplace's lent H200 (Python 3.12, torch with CUDA, no ortools),
# carry ortools and the two packages it needs that the image lacks (29 MB):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 \
#       -d .whl ortools==9.15.6755 immutabledict 'protobuf>=6.33.1,<6.34'
# and run there (carry: .whl), with a timeout that leaves time to rerun:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
#       && PYTHONPATH=/tmp/site bash benchmarks/gpu_check.sh $OUT
set -euo pipefail
out=${1:?usage: bash benchmarks/gpu_check.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
if [ "$gpus" -lt 1 ]; then
    echo "gpu_check: no CUDA GPU here (torch.cuda.is_available() is False); nothing to check" >&2
    exit 2
fi
site=$(mktemp -d)
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target "$site" .
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$out/nvidia-smi.csv" || true
python3 -c 'import autopar.cli, sys; sys.exit(autopar.cli.main())' calibrate -o "$out/gpu-profile.json" \
    --nproc "$gpus" 2>&1 | tee "$out/calibrate.log"
python3 benchmarks/kernel_times.py --write | tee "$out/kernel_times_preset.md"
python3 benchmarks/kernel_times.py --cluster "$out/gpu-profile.json" | tee "$out/kernel_times_profile.md"
cp docs/validation.md "$out/validation.md"
