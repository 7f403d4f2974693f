#!/usr/bin/env bash
# Installs the official MCP client SDK for Python (the `mcp` package, from PyPI through pip)
# into a virtual environment of its own, for the tests that drive `tandem mcp` and the
# daemon's /mcp as a real MCP client from outside the project would. Idempotent.
#
#   scripts/fetch-mcp-client.sh
#
# The environment goes to $TANDEM_MCP_CLIENT_VENV, else ~/.cache/tandem/mcp-client (where
# the tests look).
set -euo pipefail
venv="${TANDEM_MCP_CLIENT_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/tandem/mcp-client}"
version="2.3.0"
if "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('mcp') != '$version')" 2>/dev/null; then
  echo "the MCP client SDK $version is in $venv"
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "mcp==$version"
echo "installed the MCP client SDK $version in $venv"
