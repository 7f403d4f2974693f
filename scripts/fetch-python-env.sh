#!/usr/bin/env bash
# Installs what the Python client's tests need into a virtual environment of its own: the
# client itself (python/, editable, so the tests run this checkout's code), AutoGen and
# smolagents (whose executors it backs), pytest, PyYAML for the models' generator and mypy, all
# from PyPI through pip; and smolagents' source release, whose remote-executor test suite
# the client's tests run against Tandem's executor. Idempotent: a stamp of the pins skips a
# second install.
#
#   scripts/fetch-python-env.sh
#
# The environment goes to $TANDEM_PYTHON_VENV, else ~/.cache/tandem/python-env (where the
# tests look).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${TANDEM_PYTHON_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/tandem/python-env}"
pins=(
  "httpx==0.28.1"
  "autogen-agentchat==0.7.5"
  "autogen-core==0.7.5"
  "autogen-ext[docker,openai]==0.7.5"
  "smolagents[docker]==1.26.0"
  "pytest==9.2.0"
  "pytest-asyncio==1.5.0"
  "PyYAML==6.0.4"
  "mypy==2.4.1"
)
# What the stamp records: the pins, and the source release fetched beside them.
wanted="${pins[*]} sdist:smolagents==1.26.0"
stamp="$venv/.tandem-pins"
if [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$wanted" ]; then
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -e ./python
  echo "the Python test environment is in $venv"
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${pins[@]}"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -e ./python
rm -rf "$venv/upstream" && mkdir -p "$venv/upstream"
"$venv/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
  -d "$venv/upstream" "smolagents==1.26.0"
tar -xzf "$venv/upstream"/smolagents-1.26.0.tar.gz -C "$venv/upstream"
printf '%s' "$wanted" > "$stamp"
echo "installed the Python test environment in $venv"
