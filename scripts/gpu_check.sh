#!/usr/bin/env bash
# The GPU check in one call, for a lent machine: installs nothing, writes OUT/*.json as each section
# ends, stops within 9 minutes. Usage: bash scripts/gpu_check.sh [OUT]   (default: $OUT or gpu-check)
set -u
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu-check}}"
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > /dev/null 2>&1 && \
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > /dev/stderr
timeout 540 "$py" scripts/gpu_check.py --device cuda --out "$out"
