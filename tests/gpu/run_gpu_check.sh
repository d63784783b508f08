#!/bin/sh
# Device check for modelswap.vllm.gpu_ready on a machine with a real NVIDIA GPU (one command):
#   tests/gpu/run_gpu_check.sh
# Prints SKIP and exits 0 where there is no NVIDIA GPU. Under 3 minutes.
# On a bare GPU box without the venv, carry the pure-Python parts it needs:
#   .venv/lib/python3.11/site-packages/pynvml.py and .venv/lib/python3.11/site-packages/ansible
set -eu
cd "$(dirname "$0")/../.."
PY=python3
if [ -x .venv/bin/python ] && .venv/bin/python -c 'import sys' >/dev/null 2>&1; then
  PY=.venv/bin/python
fi
for d in .venv/lib/python3*/site-packages; do
  [ -d "$d" ] && PYTHONPATH="$PWD/$d${PYTHONPATH:+:$PYTHONPATH}"
done
export PYTHONPATH="${PYTHONPATH:-}"
rc=0
timeout -k 5 175 "$PY" tests/gpu/check_gpu_ready.py "$@" || rc=$?
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  echo "FAIL: the GPU check ran past its 175 s budget"
fi
exit "$rc"
