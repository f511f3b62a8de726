"""Runs an artifact's functions through mxc.runtime, then the same functions jitted from the zoo's
spec with the artifact's plan on the same 8 devices, and compares them leaf by leaf.

    python artifact_against_jit.py ARTIFACT RECOMPILE_COPY

RECOMPILE_COPY is the artifact with a manifest that forces recompiling from StableHLO. Prints one
JSON object: the compiler, spec or lark modules the runtime imported (`forbidden`, recorded before
this process imports the compiler for the reference), the RecompiledWarning messages, and for both
copies the leaf count and the largest difference of each unequal leaf."""

import json
import sys
import warnings

import jax
import numpy as np

import mxc.runtime

LEARNING_RATE = 1e-3  # the rate both train steps take: the runtime computes it, not the artifact


def run(program, batch, prompt) -> dict:
    state = program.init(3)
    first = jax.tree.map(np.asarray, state)
    evaluated = program.eval_step(state["params"], batch)
    state, metrics = program.train_step(state, batch, {"learning_rate": np.float32(LEARNING_RATE)})
    logits, cache = program.prefill(state["params"], prompt, np.full(8, 16, np.int32))  # every row 16 tokens
    step_logits, cache = program.decode(state["params"], np.argmax(np.asarray(logits), -1), cache)
    return jax.tree.map(np.asarray, {"init": first, "eval": evaluated, "state": state, "metrics": metrics,
                                     "prefill": logits, "decode": step_logits, "index": cache["index"]})


def reference_run(plan: dict, batch, prompt) -> dict:
    """The same functions jitted here from the zoo's llama3-tiny, laid out by `plan`."""
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from mxc.compiler.lower.decode import decode_step, init_cache, prefill
    from mxc.compiler.lower.optimizer import OptimizerConfig
    from mxc.compiler.lower.sharding import named_sharding, use_rules
    from mxc.compiler.lower.train import init_train_state, make_eval_step, make_train_step, train_state_shardings
    from mxc.spec.load import load_model

    spec = load_model("llama3-tiny")
    rules = {axis: tuple(mesh_axes) for axis, mesh_axes in plan["rules"].items()}
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(tuple(plan["mesh"].values())), tuple(plan["mesh"]))
    opt = OptimizerConfig()
    with use_rules(mesh, rules):
        shardings = train_state_shardings(spec, opt, mesh, rules)
        tokens = named_sharding(("batch", "seq"), mesh, rules)
        batch_shardings = {k: tokens for k in batch}
        state = jax.jit(lambda s: init_train_state(spec, opt, jax.random.key(s)), out_shardings=shardings)(np.int32(3))
        first = jax.tree.map(np.asarray, state)
        evaluated = jax.jit(make_eval_step(spec), in_shardings=(shardings.params, batch_shardings))(state.params, batch)
        step = make_train_step(spec, opt, microbatches=plan["microbatches"], remat=plan["remat"])
        state, metrics = jax.jit(step, in_shardings=(shardings, batch_shardings, None))(
            state, batch, np.float32(LEARNING_RATE))
        logits, cache = jax.jit(lambda p, t: prefill(spec, p, t, init_cache(spec, 8, 32)))(state.params, prompt)
        step_logits, cache = jax.jit(lambda p, t, c: decode_step(spec, p, t, c))(
            state.params, jnp.argmax(logits, -1).astype(jnp.int32), cache)
    return jax.tree.map(np.asarray, {"init": first, "eval": evaluated, "state": state, "metrics": metrics,
                                     "prefill": logits, "decode": step_logits, "index": cache["index"]})


def entry(key) -> str:
    for attribute in ("key", "name", "idx"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def flat(tree) -> dict:
    return {"/".join(entry(k) for k in path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def compare(result, expected) -> dict:
    result, expected = flat(result), flat(expected)
    assert result.keys() == expected.keys(), sorted(set(result) ^ set(expected))
    unequal = {k: float(np.max(np.abs(result[k].astype(np.float64) - expected[k].astype(np.float64))))
               for k in result if not np.array_equal(result[k], expected[k])}
    return {"leaves": len(result), "unequal": unequal}


def main(artifact: str, recompile_copy: str) -> None:
    program = mxc.runtime.load(artifact)
    rng = np.random.default_rng(0)
    sequences = rng.integers(0, 512, (8, 33))
    mask = (rng.random((8, 32)) < 0.9).astype(np.float32)
    batch = {"inputs": sequences[:, :-1], "targets": sequences[:, 1:], "mask": mask}
    # Packed documents, ended by a token the rows hold, so both programs mask attention between them.
    from mxc.runtime.data import document_layout
    batch["segment_ids"], batch["positions"] = document_layout(batch["inputs"], int(sequences[0, 10]))
    prompt = sequences[:, :16]

    native = run(program, batch, prompt)
    forbidden = sorted(m for m in sys.modules if m.startswith(("mxc.spec", "mxc.compiler", "lark")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recompiled = run(mxc.runtime.load(recompile_copy), batch, prompt)
    warned = [str(w.message) for w in caught if issubclass(w.category, mxc.runtime.RecompiledWarning)]

    # The plan the artifact was compiled with: the same layout, the same sums.
    reference = reference_run(program.manifest.plan, batch, prompt)
    print(json.dumps({"forbidden": forbidden, "warned": warned, "native": compare(native, reference),
                      "recompiled": compare(recompiled, reference),
                      "loss": float(native["metrics"]["loss"]), "index": int(native["index"])}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
