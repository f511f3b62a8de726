#!/usr/bin/env bash
# One-time setup: a virtual environment in .venv with mxc (editable), libtpu for compiling to TPU
# topologies on any host, and the test references (CPU PyTorch + HF transformers).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install --quiet --upgrade pip
# The CPU build first: a bare `torch` requirement would otherwise fetch the CUDA build.
.venv/bin/pip install --quiet torch==2.13.0
.venv/bin/pip install --quiet -e ".[tpu,test]"
# jemalloc makes XLA's TPU compiles about a quarter cheaper in CPU time and a fifth smaller in
# memory (mxc.compiler.allocator); mxc uses it when the host has it and works the same without.
if ! ldconfig -p 2>/dev/null | grep libjemalloc.so.2 > /dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
        apt-get install -y -q libjemalloc2 > /dev/null 2>&1 \
            || { apt-get update -q > /dev/null 2>&1 && apt-get install -y -q libjemalloc2 > /dev/null 2>&1; } \
            || echo "note: could not install libjemalloc2; mxc compiles with the system allocator"
    else
        echo "note: install jemalloc (Debian/Ubuntu: apt-get install libjemalloc2) for faster compiles"
    fi
fi
echo "mxc is installed in .venv: run .venv/bin/mxc --help"
