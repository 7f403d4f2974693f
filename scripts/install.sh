#!/usr/bin/env bash
# Sets Tandem up on this machine: the system packages its build needs (with apt-get, when
# they are missing), `tandem` into ~/.cargo/bin, and a coding model that runs inside Tandem
# (Qwen2.5-Coder-1.5B-Instruct, 1.1 GB; pass `qwen2.5-coder-0.5b` for a small machine), so
# that `tandem run` works with no API key and no network.
#
#   scripts/install.sh [MODEL]
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
# llama.cpp, the embedded model's engine, is compiled from source (cmake, a C++ compiler)
# and bound to Rust by bindgen (libclang).
command -v cmake >/dev/null || missing+=(cmake)
command -v c++ >/dev/null || missing+=(g++)
# The C library itself: libclang-cpp, which some systems carry alone, is not it.
compgen -G '/usr/lib/llvm-*/lib/libclang.so*' >/dev/null \
  || compgen -G '/usr/lib/*/libclang-[0-9]*.so*' >/dev/null \
  || missing+=(libclang-dev clang)
command -v python3 >/dev/null || missing+=(python3)
python3 -m pip --version >/dev/null 2>&1 || missing+=(python3-pip)
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing system packages: ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq "${missing[@]}"
fi

cargo install --locked --path cli
bin="${CARGO_HOME:-$HOME/.cargo}/bin"
# The binary keeps its code and nothing else: its line tables and symbols go to
# .debug/tandem.debug beside it, which a backtrace finds by the link left in the binary, so
# a panic still names functions, files and lines. Without objcopy (binutils) it stays whole.
if command -v objcopy >/dev/null; then
  mkdir -p "$bin/.debug"
  objcopy --only-keep-debug "$bin/tandem" "$bin/.debug/tandem.debug"
  objcopy --strip-all --add-gnu-debuglink="$bin/.debug/tandem.debug" "$bin/tandem"
fi
"$bin/tandem" model pull "$@"
