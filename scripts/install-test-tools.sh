#!/usr/bin/env bash
# Installs what the tests drive besides Tandem itself, from the system packages when they are
# missing: Chromium and its WebDriver (the web page is tested in a real browser), tmux
# (`tandem run --approve` is tested in a real terminal) and the PostgreSQL server (the shared
# task store is tested against a real one, started by the tests with initdb).
set -euo pipefail

missing=()
command -v chromium >/dev/null || missing+=(chromium)
command -v chromedriver >/dev/null || missing+=(chromium-driver)
command -v tmux >/dev/null || missing+=(tmux)
compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || missing+=(postgresql)
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing system packages: ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi
pg=$(compgen -G '/usr/lib/postgresql/*/bin/postgres' | sort -V | tail -1)
echo "test tools: $(chromium --version 2>/dev/null | head -1), $(chromedriver --version | cut -d' ' -f1-2), $(tmux -V), $("$pg" --version)"
