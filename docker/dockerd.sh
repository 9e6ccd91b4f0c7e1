#!/usr/bin/env bash
# Make sure a Docker daemon answers: install Debian's docker.io when dockerd is missing, start dockerd when no daemon
# answers, and wait for it (up to 60 s). Idempotent: with a daemon up it does nothing. Exit 1 (with the daemon's last
# log lines) when none can be started.
#   bash docker/dockerd.sh
set -euo pipefail
LOG=${DOCKERD_LOG:-/var/log/ppharness-dockerd.log}

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
say() { echo "dockerd: $*" >&2; }
answers() { as_root docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }

if command -v docker >/dev/null 2>&1 && answers; then
  exit 0
fi
if ! command -v dockerd >/dev/null 2>&1 || ! command -v docker >/dev/null 2>&1; then
  say "installing Debian's docker.io"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq docker.io >/dev/null
fi
if ! answers; then
  if [ -d /run/systemd/system ]; then
    say "starting docker.service"
    as_root systemctl start docker
  else
    say "starting dockerd (log: $LOG)"
    as_root sh -c "nohup setsid dockerd >>'$LOG' 2>&1 </dev/null &"
  fi
fi
for _ in $(seq 1 60); do
  if answers; then
    say "daemon $(as_root docker version --format '{{.Server.Version}}') answers" \
        "($(as_root docker info --format '{{.Driver}}, cgroup v{{.CgroupVersion}}' 2>/dev/null))"
    exit 0
  fi
  sleep 1
done
say "no Docker daemon answers after 60 s; last lines of its log:"
as_root tail -n 20 "$LOG" >&2 2>/dev/null || true
exit 1
