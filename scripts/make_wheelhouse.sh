#!/usr/bin/env bash
# Download, on a machine with PyPI access, the wheels scripts/gpu_check.sh may need on a GPU machine
# that has torch and transformers but no network (CPython 3.12, x86_64 Linux), into .wheelhouse/
# (git-ignored; carried to the GPU machine next to the repository). Refuses to leave more than 40 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION=${PY_VERSION:-3.12}
rm -rf .wheelhouse && mkdir -p .wheelhouse
grep -v '^#' scripts/gpu_requirements.txt | cut -d= -f2- | sed '/^$/d' > .wheelhouse/requirements.txt
PIP=${PIP:-.venv/bin/pip}
"$PIP" download --quiet --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --implementation cp --dest .wheelhouse -r .wheelhouse/requirements.txt
size_mb=$(du -sm .wheelhouse | cut -f1)
echo "wheelhouse: $(ls .wheelhouse/*.whl | wc -l) wheels, ${size_mb} MB in .wheelhouse/"
if [ "$size_mb" -gt 40 ]; then
    echo "error: .wheelhouse is ${size_mb} MB, over the 40 MB the GPU machine accepts" >&2
    exit 1
fi
