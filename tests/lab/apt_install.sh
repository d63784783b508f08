#!/usr/bin/env bash
# Install the lab's apt packages (make deps) without letting their maintainer scripts start
# services: Debian's haproxy package would otherwise start a haproxy of its own (with
# /etc/haproxy/haproxy.cfg) that the lab did not start and would never stop. A policy-rc.d that
# answers 101 ("action not allowed") is put in place for the install, unless one already decides;
# it is removed afterwards. A haproxy that runs after the install and is not a lab's is reported.
set -euo pipefail
policy=/usr/sbin/policy-rc.d
made=""
cleanup() { if [ -n "$made" ]; then rm -f "$policy"; fi; }
trap cleanup EXIT
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\n# modelswap lab (tests/lab/apt_install.sh): no service starts during this install\nexit 101\n' >"$policy"
  chmod 0755 "$policy"
  made=1
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
# A lab's load balancer runs with <state dir>/modelswap-lab-haproxy.cfg; anything else is not ours.
others=$(pgrep -a -x haproxy | grep -v -- "modelswap-lab-haproxy.cfg" || true)
if [ -n "$others" ]; then
  echo "warning: a haproxy that no modelswap lab started is running (it was not stopped):" >&2
  echo "$others" >&2
fi
