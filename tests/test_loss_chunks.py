"""The output head and cross entropy over pieces of the sequence (LoweringChoices.loss_chunks):
the loss, its statistics and every gradient equal the unchunked program's to float32 rounding,
tied and untied heads, with masked targets; and the chunked program never holds the whole
float32 logits."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mxc.compiler.lower.choices import LoweringChoices, use_lowering
from mxc.compiler.lower.loss import chunked_loss_sums, loss_sums
from mxc.compiler.lower.params import init_params
from mxc.compiler.lower.train import model_loss_sums
from mxc.spec.load import load_model

SEQ = 32


def _spec(tied: bool, vocab: int = 512):
    spec = load_model("llama3-tiny").model_copy(update={"compute_dtype": "float32", "vocab": vocab})
    return spec.model_copy(update={"embedding": spec.embedding.model_copy(update={"tied": tied})})


def _batch(spec, batch: int = 2):
    tokens = jax.random.randint(jax.random.key(1), (batch, SEQ + 1), 0, spec.vocab)
    mask = jax.random.bernoulli(jax.random.key(2), 0.7, (batch, SEQ)).astype(jnp.float32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


def _choices(chunks: int, fused: bool) -> LoweringChoices:
    return dataclasses.replace(LoweringChoices.for_platform("cpu"), loss_chunks=chunks, fused_cross_entropy=fused)


# Each head with one of the two cross entropies (the fused one is the CPU plans').
@pytest.mark.parametrize("tied, fused", [(False, False), (True, True)])
def test_chunked_loss_and_gradients_equal_the_whole_logits(tied, fused):
    spec = _spec(tied)
    params = init_params(spec, jax.random.key(0))
    batch = _batch(spec)
    sums_fn = model_loss_sums(spec, remat="full", z_loss_weight=1e-3)

    def run(chunks: int):
        def total(p):
            sums = sums_fn(p, batch)
            return sums.total(), sums

        with use_lowering(_choices(chunks, fused)):
            return jax.jit(jax.grad(total, has_aux=True))(params)

    plain_grads, plain = run(1)
    grads, chunked = run(4)
    for name in ("cross_entropy", "z_loss", "correct", "tokens"):
        np.testing.assert_allclose(getattr(chunked, name), getattr(plain, name), rtol=2e-6, err_msg=name)
    assert float(plain.tokens) < 2 * SEQ  # some targets are masked
    assert ("head" in grads) is not tied
    flat = jax.tree_util.tree_leaves_with_path(grads)
    for (path, got), want in zip(flat, jax.tree.leaves(plain_grads)):
        scale = float(jnp.max(jnp.abs(want)))
        assert scale > 0, jax.tree_util.keystr(path)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))


def test_each_piece_takes_every_chunks_th_token():
    """Piece j is tokens j, j + k, ...: the sums do not depend on the split, so a wrong
    reassembly of targets and hidden states is what would show."""
    keys = jax.random.split(jax.random.key(0), 4)
    hidden = jax.random.normal(keys[0], (3, 12, 8), jnp.float32)
    kernel = jax.random.normal(keys[1], (8, 11), jnp.float32)
    targets = jax.random.randint(keys[2], (3, 12), 0, 11)
    mask = jax.random.bernoulli(keys[3], 0.6, (3, 12)).astype(jnp.float32)
    logits_of = lambda h: h @ kernel  # noqa: E731
    whole = loss_sums(logits_of(hidden), targets, mask)
    for chunks in (3, 12):
        pieces = chunked_loss_sums(logits_of, hidden, targets, mask, chunks)
        np.testing.assert_allclose(pieces.cross_entropy, whole.cross_entropy, rtol=1e-6)
        np.testing.assert_allclose(pieces.correct, whole.correct)
    with pytest.raises(ValueError, match="5 chunks do not divide the sequence of 12 tokens"):
        chunked_loss_sums(logits_of, hidden, targets, mask, 5)


def test_the_chunked_program_never_holds_the_whole_logits():
    """The compiled train step's temporaries, on CPU: the whole float32 logits (and their
    gradient) in the plain program, one piece's in the chunked one."""
    spec = _spec(tied=False, vocab=8192)
    params = jax.eval_shape(lambda: init_params(spec, jax.random.key(0)))
    batch = jax.eval_shape(lambda: _batch(spec, batch=4))
    sums_fn = model_loss_sums(spec, remat="full")
    logits = 4 * SEQ * spec.vocab * 4

    def temporaries(chunks: int) -> int:
        with use_lowering(_choices(chunks, fused=True)):
            step = jax.jit(jax.grad(lambda p, b: sums_fn(p, b).total()))
            return step.lower(params, batch).compile().memory_analysis().temp_size_in_bytes

    plain, chunked = temporaries(1), temporaries(8)
    assert plain >= logits  # the logits (4 MiB here) at least
    assert chunked < plain - logits / 2, (plain, chunked)


def test_the_search_splits_the_loss_only_where_the_whole_logits_do_not_fit():
    """Llama 3.1 8B on v6e-256, fsdp 256, full remat, one microbatch: 8 sequences of 8192 per
    device hold 31.3 GiB of float32 logits, which do not fit beside anything, so the loss runs in
    pieces; at 4 sequences per device in 4 microbatches the whole logits are predicted to fit and
    the pieces, a head matmul slower, are not offered."""
    from mxc.compiler.plan import plan
    from mxc.compiler.topology import parse

    spec, topology = load_model("llama3.1-8b"), parse("v6e-256")
    chosen = plan(spec, topology, seq=8192, batch=2048, pins={"fsdp": 256}, remat="full", microbatches=1,
                  verify=False)
    assert chosen.lowering.loss_chunks == chosen.lowering_choices().loss_chunks == 64
    assert chosen.fits and chosen.predicted.total < topology.usable_hbm_bytes
    whole = plan(spec, topology, seq=8192, batch=1024, pins={"fsdp": 256}, remat="minimal_with_context",
                 microbatches=4, verify=False)
    assert whole.lowering.loss_chunks == 1 and all(c.loss_chunks == 1 for c in whole.candidates)
    small = plan(load_model("llama3-tiny"), parse("v5p-8"), seq=64, batch=16, verify=False)
    assert small.lowering.loss_chunks == 1
