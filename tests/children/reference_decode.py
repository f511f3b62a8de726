"""Greedy decoding by the plain full forward, for comparing an artifact's generation against.

    python reference_decode.py CKPT STEP PROMPTS.npy MAX_NEW GENERATED.npy OUTPUT.npz

Each new token is the argmax of the full forward over the sequence so far, re-run per token on
one device: no KV cache, no prefill or decode step, no sampler. OUTPUT holds those tokens
(`tokens`, prompt included) and the full forward's logits over the sequences in GENERATED
(`logits`, teacher-forced). Needs the tests folder on PYTHONPATH (runtime_support)."""

import sys

import jax
import jax.numpy as jnp
import numpy as np

from mxc.compiler.lower.model import forward
from mxc.spec.load import load_model
from runtime_support import restore_on_one_device


def greedy_by_full_forward(spec, params, prompts: np.ndarray, max_new: int) -> np.ndarray:
    rows, length = prompts.shape
    # One width for every step, so the forward compiles once: causal attention keeps the zeros
    # after position t out of the logits at t.
    tokens = np.zeros((rows, length + max_new), np.int32)
    tokens[:, :length] = prompts
    logits_of = jax.jit(lambda p, t: forward(spec, p, t)[0])
    for t in range(length, length + max_new):
        tokens[:, t] = np.asarray(jnp.argmax(logits_of(params, tokens)[:, t - 1], axis=-1))
    return tokens


def main(ckpt: str, step: str, prompts: str, max_new: str, generated: str, output: str) -> None:
    params = restore_on_one_device(ckpt, int(step))
    spec = load_model("llama3-tiny")
    tokens = greedy_by_full_forward(spec, params, np.load(prompts), int(max_new))
    logits, _ = forward(spec, params, np.load(generated))
    np.savez(output, tokens=tokens, logits=np.asarray(logits, np.float32))


if __name__ == "__main__":
    main(*sys.argv[1:])
