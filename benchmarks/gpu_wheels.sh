#!/usr/bin/env bash
# Wheels the GPU machine lacks, for Python 3.12 on x86-64, into .whl/ of the repository root (ignored by git).
#
# The GPU machine (see /work/.library/device/KINDS.md) has torch 2.11, pytorch-lightning and lightning 2.6.6,
# lightning-utilities, torchmetrics, transformers, nvidia-ml-py, psutil, rich, matplotlib, pyyaml and no package
# registry. What memplan imports on the campaign's paths is all there; jsonargparse with its `signatures` extra
# (which pytorch_lightning.cli.LightningCLI needs: launch/train.py, launch/torchrun.sh) is not. Versions are the
# ones the project's venv runs its tests with.
#
#   bash benchmarks/gpu_wheels.sh [DEST]     # DEST defaults to .whl in the repository root
#
# Then, for the device tool: copy DEST into the checkout the session was started in (e.g. /work/main/.whl, which
# .git/info/exclude must ignore: echo /.whl/ >> .git/info/exclude) and name `.whl` in the run call's `carry`.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="${1:-$root/.whl}"
python="${PYTHON:-python3}"
wheels=(
  "jsonargparse==4.53.0"
  "docstring-parser==0.18.0"
  "typeshed-client==2.14.0"
)
mkdir -p "$dest"
"$python" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest" "${wheels[@]}"
ls -l "$dest"
