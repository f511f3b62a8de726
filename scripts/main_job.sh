#!/usr/bin/env bash
# The main job: compile Llama 3.1 8B for a v5p-1024 pod on this host (libtpu describes the pod;
# no TPU needed) and show its plan and memory; then compile a tiny Llama for this machine's CPU
# devices and train it for a few dozen steps on text.
set -euo pipefail
cd "$(dirname "$0")/.."
export ALLOW_MULTIPLE_LIBTPU_LOAD=1
mxc=.venv/bin/mxc
mkdir -p build

$mxc compile llama3.1-8b --topology v5p-1024 -o build/llama3.1-8b-v5p-1024 --force
$mxc inspect build/llama3.1-8b-v5p-1024

export XLA_FLAGS=--xla_force_host_platform_device_count=8
$mxc compile llama3-tiny --topology cpu-8 --seq 128 --batch 16 -o build/llama3-tiny-cpu-8 --force
$mxc tokenize README.md docs/*.md -o build/text.bin
rm -rf build/ckpt build/tensorboard
# The schedule is the run's: a tiny model takes a larger peak than the artifact's default 3e-4.
$mxc run build/llama3-tiny-cpu-8 --data build/text.bin --steps 40 --ckpt-dir build/ckpt \
  --learning-rate 3e-3 --metrics build/metrics.jsonl --eval-data build/text.bin --eval-every 20 \
  --tensorboard build/tensorboard
