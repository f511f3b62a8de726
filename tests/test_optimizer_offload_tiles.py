"""Moments kept in host memory on a TPU (LoweringChoices.optimizer_state_on_host) only where
libtpu lays out their per-device pieces there (optimizer.host_tiles_accept): with a piece's last
two dimensions not multiples of 8 (DeepSeek V3's 7168 split 256 ways: 28) libtpu refuses the
update's program, not for memory. Compiled for a v5p slice's description (libtpu, no TPU needed);
docs/plans.md, "Optimizer state on host"."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from mxc.compiler.lower import optimizer
from mxc.compiler.lower.choices import LoweringChoices, use_lowering
from mxc.compiler.lower.optimizer import OptimizerConfig, host_tiles_accept
from mxc.compiler.lower.sharding import use_rules
from mxc.compiler.lower.train import abstract_train_state, layered_optimizer, train_state_shardings
from mxc.compiler.topology import device_mesh, parse
from mxc.spec.load import load_model

RULES = {"batch": ("fsdp",), "experts": ("fsdp",), "embed": ("fsdp",)}


def test_host_tiles_accept_the_shapes_libtpu_compiled():
    # Per-device shapes of a layer stack compiled for v5p-8 (a scan moving each layer's piece in
    # from host memory and back): these compiled ...
    for shape in [(58, 1024, 56), (58, 128, 56, 1024), (1, 1024, 32), (58, 24, 576), (58, 512, 2, 128),
                  (58, 4, 1024), (58, 8192)]:
        assert host_tiles_accept(shape, stacked=True), shape
    # ... these did not (bitcast, tile-layout or lane-update errors).
    for shape in [(1, 1024, 28), (58, 28, 576), (58, 1024, 20), (58, 9, 128), (58, 6, 1024), (58, 32),
                  (58, 32, 2, 16)]:
        assert not host_tiles_accept(shape, stacked=True), shape
    assert not host_tiles_accept((), stacked=False)


def _compile_update(spec, config, mesh):
    state_shardings = train_state_shardings(spec, config, mesh, RULES, moments_on_host=True)
    abstract = abstract_train_state(spec, config)
    choices = dataclasses.replace(LoweringChoices.for_platform("tpu"), optimizer_state_on_host=True)

    def update(grads, opt_state, params):
        with use_lowering(choices):
            return layered_optimizer(spec, config).update(grads, opt_state, params, learning_rate=jnp.float32(1e-3))

    shardings = (state_shardings.params, state_shardings.opt_state, state_shardings.params)
    with use_rules(mesh, RULES):
        jax.jit(update, in_shardings=shardings, out_shardings=(state_shardings.params, state_shardings.opt_state)
                ).lower(abstract.params, abstract.opt_state, abstract.params).compile()
    return state_shardings


def _setup():
    # d_model 112 split over fsdp 4: pieces of 28, as DeepSeek V3's 7168 over 256 devices, where
    # fsdp splits the embedding; the experts take fsdp in their weights, which keep 112 whole.
    # One-layer stacks (mla-tiny's dense layer and MTP module), as DeepSeek V3's MTP module.
    spec = load_model("mla-tiny").model_copy(update={"d_model": 112})
    topology = parse("v5p-8")
    mesh = device_mesh(topology, ("fsdp",), (topology.chips,))
    return spec, OptimizerConfig(learning_rate=1e-3, warmup_steps=0, total_steps=10), mesh


def test_moments_libtpu_cannot_lay_out_stay_in_hbm_and_the_update_compiles():
    spec, config, mesh = _setup()
    state_shardings = _compile_update(spec, config, mesh)
    kinds = [s.memory_kind for s in jax.tree.leaves(state_shardings.opt_state)]
    # The pieces of 28 stay in HBM, the experts' (2 x 112 x 32 a layer) go to host.
    assert "pinned_host" in kinds and "device" in kinds


def test_every_moment_on_host_is_refused_by_libtpu(monkeypatch):
    spec, config, mesh = _setup()
    monkeypatch.setattr(optimizer, "host_tiles_accept", lambda shape, stacked: True)
    with pytest.raises(Exception, match="Bitcast|tile kind|lane"):
        _compile_update(spec, config, mesh)
