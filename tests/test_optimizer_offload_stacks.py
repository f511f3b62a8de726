"""The update that brings AdamW's moments from host memory a layer at a time
(train.layered_optimizer) on a model whose layer stacks differ in depth: DeepSeek V3's dense,
MoE and MTP stacks (3, 58 and 1 layers; mla-tiny's 1, 2 and 1) loop apart. One loop over all of
them failed to trace ("scan got values with different leading axis sizes"), so no DeepSeek V3 plan
with the moments on host could compile (docs/plans.md, "The largest models")."""

import dataclasses

import jax
import numpy as np

from mxc.compiler.lower.choices import LoweringChoices, use_lowering
from mxc.compiler.lower.optimizer import OptimizerConfig
from mxc.compiler.lower.params import init_params, param_axes
from mxc.compiler.lower.train import layered_optimizer, model_optimizer
from mxc.spec.load import load_model


def test_stacks_of_different_depths_update_as_the_plain_optimizer():
    spec = load_model("mla-tiny")
    depths = {a[:1] == ("layers",) and p.shape[0]
              for a, p in zip(jax.tree.leaves(param_axes(spec), is_leaf=lambda a: isinstance(a, tuple)),
                              jax.tree.leaves(init_params(spec, jax.random.key(0))))}
    assert len(depths - {False}) > 1  # the case under test: stacks of more than one depth
    config = OptimizerConfig(learning_rate=1e-3, warmup_steps=0, total_steps=10)
    params = init_params(spec, jax.random.key(0))
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    grads = treedef.unflatten([jax.random.normal(k, p.shape, p.dtype) for k, p in zip(keys, leaves)])
    choices = dataclasses.replace(LoweringChoices.for_platform("cpu"), optimizer_state_on_host=True)

    def layered_update(grads, state, params):
        with use_lowering(choices):
            return layered_optimizer(spec, config).update(grads, state, params)

    plain = model_optimizer(spec, config)
    state = plain.init(params)
    want = jax.jit(plain.update)(grads, state, params)
    got = jax.jit(layered_update)(grads, state, params)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-8,
                                   err_msg=jax.tree_util.keystr(path))
