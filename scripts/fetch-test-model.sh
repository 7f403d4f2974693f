#!/usr/bin/env bash
# Fetches the model the embedded-model tests load, Qwen2.5-Coder-0.5B-Instruct (Q4_K_M,
# 491 MB), with Tandem's own `tandem model pull`: the first source that serves it, checked
# by sha256. Idempotent: a model already pulled is kept.
#
#   scripts/fetch-test-model.sh
#
# The file goes to $TANDEM_MODELS_DIR, else $XDG_CACHE_HOME/tandem/models, else
# ~/.cache/tandem/models (where Tandem and the tests look).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo run --quiet --locked -p tandem-cli -- model pull qwen2.5-coder-0.5b
