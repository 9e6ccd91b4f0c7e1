#!/usr/bin/env bash
# Set up ppharness on a fresh Debian/Ubuntu machine: system packages, a virtual environment, the project.
#   bash setup.sh                 # venv in ./.venv
#   bash setup.sh --tests         # also what the test suite needs: Debian's docker.io and a running dockerd
#   VENV=/path/to/venv bash setup.sh
# Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${VENV:-.venv}
TESTS=0
for arg in "$@"; do
  case "$arg" in
    --tests) TESTS=1 ;;
    *) echo "setup: unknown argument $arg (known: --tests)" >&2; exit 2 ;;
  esac
done
PYTHON=${PYTHON:-python3}

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# tinygrad's CPU backend compiles its kernels with clang
if ! command -v clang >/dev/null 2>&1; then
  echo "setup: installing clang (tinygrad's CPU compiler)" >&2
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq clang >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating virtual environment $VENV" >&2
  "$PYTHON" -m venv "$VENV"
fi
echo "setup: installing ppharness and its test tools into $VENV" >&2
"$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
"$VENV/bin/python" -m pip install -q -e '.[test,bench]' 2>&1 | grep -v '^WARNING: Location' || true
"$VENV/bin/python" -c "import ppharness.cli, tinygrad, zmq, gguf" || { echo "setup: the install is incomplete" >&2; exit 1; }
echo "setup: done; commands are in $VENV/bin (pp-smoke-run, pp-node, ppharness)" >&2
if [ "$TESTS" = 1 ]; then
  # the docker tests need a daemon; without one they skip with that reason (and fail under CI=true)
  bash docker/dockerd.sh || echo "setup: no Docker daemon could be started; the docker tests cannot run" >&2
fi
