#!/usr/bin/env bash
# The GPU check, run as is on a machine with CUDA: bash tests/gpu/run.sh [pytest options]
# Needs torch with CUDA, lightning, torchmetrics and pytest (pytest-timeout optional); no network.
# One GPU: the compute path on CUDA (with fused gradient accumulation), P=1, and P=2 with two processes sharing the GPU over gloo.
# Two or more GPUs: NCCL point-to-point as well (P=2, and P=2 x D=2 with four), and benchmarks/real_schedules.py's
# comparison of torch's schedules with ours (its table is printed in the log).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
nvidia-smi -L || true
python -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -m pytest -q -p no:cacheprovider -o addopts="" -m gpu -rA tests/gpu "$@"
