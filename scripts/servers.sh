#!/usr/bin/env bash
# The stores the fleet tests and `qladder bench fleet` start (src/qladder/peers/stores.py): Redis and PostgreSQL, from Debian's
# packages (the registries this project may use). Installs only what is missing; the tests do not
# use the packages' own services (they launch the binaries on free ports in temp dirs).
# Needs root (or sudo) the first time; prints what it found.
set -euo pipefail
have_pg() { command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; }
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
have_pg || missing+=(postgresql)
if ((${#missing[@]})); then
  sudo=""
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "scripts/servers.sh: need root or sudo to install ${missing[*]}" >&2; exit 1; }
    sudo="sudo"
  fi
  echo "installing ${missing[*]} from Debian's packages" >&2
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get install -y -q "${missing[@]}" >/dev/null || { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q "${missing[@]}" >/dev/null; }
fi
echo "redis-server: $(redis-server --version | cut -d' ' -f3)" >&2
echo "postgres: $( (command -v postgres || ls /usr/lib/postgresql/*/bin/postgres | sort | tail -1) | head -1)" >&2
