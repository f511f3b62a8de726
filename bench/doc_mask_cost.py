"""What document masking costs a train step: the same jitted step (XLA attention, CPU) on a batch
without segment ids and positions (the program before document masking) and on one with them
(what an artifact runs now), in interleaved rounds; prints the median step time of each.

    python bench/doc_mask_cost.py [--model llama-20m-v1024] [--batch 8] [--seq 256] [--rounds 3] [--steps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).parent))

import jax
import numpy as np

from runtime_common import MODELS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-20m-v1024", choices=sorted(MODELS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    from mxc.compiler.lower.optimizer import OptimizerConfig
    from mxc.compiler.lower.train import init_train_state, make_train_step
    from mxc.runtime.data import document_layout
    from mxc.spec.load import load_text

    (spec,) = load_text(MODELS[args.model].mspec(), "<bench>").values()
    config = OptimizerConfig()
    step = jax.jit(make_train_step(spec, config, remat="none"), donate_argnums=0)
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, spec.vocab, (args.batch, args.seq + 1)).astype(np.int32)
    tokens[rng.random(tokens.shape) < 1 / 64] = 0  # documents of about 64 tokens, ended by id 0
    plain = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": np.ones((args.batch, args.seq), np.float32)}
    segment_ids, positions = document_layout(plain["inputs"], 0)
    batches = {"without segment ids": plain, "with segment ids": {**plain, "segment_ids": segment_ids,
                                                                 "positions": positions}}
    states = {name: init_train_state(spec, config, jax.random.key(0)) for name in batches}
    for name, batch in batches.items():  # compile and warm up
        states[name], metrics = step(states[name], batch)
        jax.block_until_ready(metrics)
    times = {name: [] for name in batches}
    for _ in range(args.rounds):
        for name, batch in batches.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                states[name], metrics = step(states[name], batch)
            jax.block_until_ready(metrics)
            times[name].append((time.perf_counter() - start) / args.steps)
    base = statistics.median(times["without segment ids"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:20s} median {median * 1e3:8.1f} ms/step  ({median / base:.3f}x)  rounds: "
              + ", ".join(f"{v * 1e3:.1f}" for v in values))


if __name__ == "__main__":
    main()
