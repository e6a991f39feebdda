#!/usr/bin/env bash
# The folder of wheels benchmarks/gpu/run.sh installs on a GPU machine without network: distlm's
# dependencies that the machine's image lacks (benchmarks/gpu/wheels.txt, the versions CI passed
# with: constraints.txt), for its Python 3.12 on x86-64.
#
#   bash benchmarks/gpu/wheels.sh .whl             # here, with PyPI: fills .whl/
#   bash benchmarks/gpu/wheels.sh .whl uccl==0.1.1 # and more wheels (uccl: the broadcast over UCCL)
#
# Each line is `pip download --no-deps --only-binary=:all: --python-version 3.12 ...` (binary
# wheels for that Python and manylinux x86-64); a package PyPI has only as a source archive (pure
# Python, e.g. connection_pool) is built into a py3-none-any wheel here with `pip wheel --no-deps`.
set -euo pipefail
dest=${1:?usage: benchmarks/gpu/wheels.sh DEST [MORE_REQUIREMENTS...]}
shift
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$dest"
platforms=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${p}_x86_64")
done
mapfile -t reqs < <(grep -vE '^\s*(#|$)' "$here/wheels.txt")
reqs+=("$@")
for req in "${reqs[@]}"; do
  if ! python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${platforms[@]}" -d "$dest" "$req" 2>/dev/null; then
    echo "wheels.sh: $req has no binary wheel for CPython 3.12: building it (pure Python only)"
    python3 -m pip wheel -q --disable-pip-version-check --no-deps -w "$dest" "$req"
  fi
done
bad=$(find "$dest" -type f -name '*.whl' ! -name '*-none-any.whl' ! -name '*cp312*' ! -name '*abi3*' ! -name '*py3-none*')
if [ -n "$bad" ]; then
  echo "wheels.sh: wheels for another Python in $dest (built here, not pure Python):" >&2
  echo "$bad" >&2
  exit 1
fi
echo "wheels.sh: $(find "$dest" -name '*.whl' | wc -l) wheels, $(du -sh "$dest" | cut -f1), in $dest"
