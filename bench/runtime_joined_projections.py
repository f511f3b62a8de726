"""The CPU decode step with each layer's q/k/v and gate/up kernels joined (runtime/layer_layout.py,
LoweringChoices.joined_serving_projections) against the same step with them apart, in one
process: the same random weights (a preset of runtime_common.MODELS, float32, batch 1), the serving
functions jitted as `mxc generate MODEL` jits them, blocks of decode steps alternating between the
two. Prints the medians of each step's wall and CPU time (process CPU, every thread), of one
prefill's wall per block, and the greedy tokens' agreement.

    .venv/bin/python bench/runtime_joined_projections.py [--model smollm2-135m] [--rounds 10] [--steps 20] [--prompt 32]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).parent))
from runtime_common import MODELS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS))
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20, help="decode steps per block")
    args = parser.parse_args()

    import jax
    import numpy as np

    from mxc.compiler.lower.choices import LoweringChoices, use_lowering
    from mxc.compiler.lower.decode import serving_steps
    from mxc.compiler.lower.params import init_params
    from mxc.runtime.layer_layout import has_joined, per_layer_arrays
    from mxc.spec.load import load_text

    model = MODELS[args.model]
    spec = load_text(model.mspec())[model.name]
    params = init_params(spec, jax.random.key(0))
    cache_len = args.prompt + args.rounds * args.steps + 8
    prompt = np.random.default_rng(0).integers(0, spec.vocab, (1, args.prompt)).astype(np.int32)
    cpu = LoweringChoices.for_platform("cpu")
    variants = {}
    for name, choices in (("joined", cpu), ("apart", dataclasses.replace(cpu, joined_serving_projections=False))):
        with use_lowering(choices):
            layered = per_layer_arrays(params)
            assert has_joined(layered) == (name == "joined")
            run_prefill, run_decode = serving_steps(spec, 1, cache_len, dtype="float32")
            prefill, decode = jax.jit(run_prefill), jax.jit(run_decode, donate_argnums=2)
            logits, cache = prefill(layered, prompt, np.array([args.prompt], np.int32))
            token = np.argmax(np.asarray(logits), -1).astype(np.int32)
            logits, cache = decode(layered, token, cache)  # compiled and warm
            variants[name] = {"params": layered, "prefill": prefill, "decode": decode, "cache": cache,
                              "logits": logits, "tokens": [], "wall": [], "cpu": [], "prefill_wall": []}
    for _ in range(args.rounds):
        for variant in variants.values():
            wall = time.perf_counter()
            jax.block_until_ready(variant["prefill"](variant["params"], prompt, np.array([args.prompt], np.int32)))
            variant["prefill_wall"].append(time.perf_counter() - wall)
            logits, cache = variant["logits"], variant["cache"]
            for _ in range(args.steps):
                token = np.argmax(np.asarray(logits), -1).astype(np.int32)
                variant["tokens"].append(int(token[0]))
                wall, cpu_time = time.perf_counter(), time.process_time()
                logits, cache = variant["decode"](variant["params"], token, cache)
                logits.block_until_ready()
                variant["wall"].append(time.perf_counter() - wall)
                variant["cpu"].append(time.process_time() - cpu_time)
            variant["logits"], variant["cache"] = logits, cache
    joined, apart = variants["joined"], variants["apart"]
    for name, variant in variants.items():
        print(f"{name}: decode step wall {statistics.median(variant['wall']) * 1e3:.2f} ms, "
              f"CPU {statistics.median(variant['cpu']) * 1e3:.2f} ms (medians of {len(variant['wall'])}); "
              f"prefill of {args.prompt} tokens wall {statistics.median(variant['prefill_wall']) * 1e3:.1f} ms "
              f"(median of {len(variant['prefill_wall'])})")
    print(f"joined / apart: wall {statistics.median(joined['wall']) / statistics.median(apart['wall']):.3f}, "
          f"CPU {statistics.median(joined['cpu']) / statistics.median(apart['cpu']):.3f}")
    print(f"greedy tokens equal: {joined['tokens'] == apart['tokens']}; last logits max |diff| "
          f"{float(np.max(np.abs(np.asarray(joined['logits']) - np.asarray(apart['logits'])))):.3g}")


if __name__ == "__main__":
    main()
