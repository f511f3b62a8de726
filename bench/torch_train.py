"""The PyTorch side of bench/runtime_throughput.py, run as its own process: transformers'
LlamaForCausalLM trained with torch's AdamW on random tokens, as a PyTorch user would write it.

The optimizer matches the artifact's (compiler/lower/optimizer.py): AdamW with b1 0.9, b2 0.95,
eps 1e-8, weight decay 0.1 on matrices only, the global gradient norm clipped at 1.0. Prints one
JSON object: each step's wall and process CPU seconds, and the loss.

    python bench/torch_train.py CONFIG.json --batch 8 --seq 256 --steps 40
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="transformers LlamaConfig keyword arguments (JSON)")
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--seq", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    args = parser.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    # Every core this process may run on (taskset narrows it), as many as XLA:CPU uses.
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    torch.manual_seed(0)
    with open(args.config) as file:
        config = LlamaConfig(**json.load(file))
    model = LlamaForCausalLM(config).train()
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}],
                                  lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
    generator = torch.Generator().manual_seed(0)
    step_seconds, cpu_seconds, losses = [], [], []
    for _ in range(args.steps):
        tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), generator=generator)
        started, started_cpu = time.perf_counter(), time.process_time()
        logits = model(input_ids=tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                 tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        step_seconds.append(time.perf_counter() - started)
        cpu_seconds.append(time.process_time() - started_cpu)
    print(json.dumps({"step_seconds": step_seconds, "cpu_seconds": cpu_seconds, "losses": losses}))


if __name__ == "__main__":
    main()
