"""Training a tiny multimodal model, shared by the Gemma 3, Llama 4 and Llama 3.2 Vision tests: one
train step on packed image-text rows (checked against the forward pass run document by document),
`--freeze vision` on that step, and a cpu-8 artifact that trains and resumes bitwise."""

from __future__ import annotations

import json
import signal
import subprocess

import jax
import jax.numpy as jnp
import numpy as np


def _optimizer(freeze: tuple[str, ...] = ()):
    from mxc.compiler.lower.optimizer import OptimizerConfig

    return OptimizerConfig(learning_rate=1e-2, total_steps=10, warmup_steps=0, freeze=freeze)


def one_train_step(spec, rows: dict, *, remat: str, moved=None, freeze: tuple[str, ...] = ()):
    """A fresh train state (its parameters passed through `moved` where given) and one step on
    `rows`: (the state before, the state after, the step's metrics)."""
    from mxc.compiler.lower.train import init_train_state, make_train_step

    config = _optimizer(freeze)
    state = init_train_state(spec, config, jax.random.key(0))
    if moved is not None:
        state = state._replace(params=moved(state.params))
    step = jax.jit(make_train_step(spec, config, remat=remat))
    after, metrics = step(state, {k: jnp.asarray(v) for k, v in rows.items()})
    return state, after, metrics


def assert_freezing_the_tower_leaves_it_alone(spec, rows: dict, *, remat: str, moved=None) -> None:
    """`freeze=("vision",)`: the optimizer keeps no moments for the tower, a step leaves every tower
    parameter bitwise as it was, and the text still trains."""
    from mxc.compiler.lower.train import init_train_state

    state, after, _ = one_train_step(spec, rows, remat=remat, moved=moved, freeze=("vision",))
    full = init_train_state(spec, _optimizer(), jax.random.key(0))
    tower_leaves = len(jax.tree.leaves(state.params["vision"]))
    assert tower_leaves > 0
    # Adam's two moments per parameter, for the text's parameters only
    assert len(jax.tree.leaves(full.opt_state)) - len(jax.tree.leaves(state.opt_state)) == 2 * tower_leaves
    for before, now in zip(jax.tree.leaves(state.params["vision"]), jax.tree.leaves(after.params["vision"])):
        assert np.array_equal(before, now)
    assert not np.array_equal(state.params["final_norm"]["scale"], after.params["final_norm"]["scale"])


def masked_nll(logits, targets, mask) -> tuple[float, int]:
    """The summed negative log-likelihood of `targets` under `logits` [positions, vocab] where
    `mask` is set, in float64, and how many positions counted."""
    logits = np.asarray(logits, np.float64)
    top = logits.max(-1, keepdims=True)
    log_probs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return -float(np.sum(log_probs[np.arange(len(targets)), targets] * mask)), int(mask.sum())


def train_step_batch_shapes(manifest: dict) -> dict:
    """An artifact's train-step batch inputs: {path within the batch: shape}."""
    return {tuple(leaf["path"][1:]): leaf["shape"] for leaf in manifest["functions"]["train_step"]["inputs"]
            if leaf["path"][0] == 1}


def compile_for_cpu8(model: str, artifact, *extra: str) -> dict:
    """`mxc compile MODEL --topology cpu-8 --pin fsdp=8 ...` (parameters sharded over all eight
    devices, so the tower's and the text's parameter gathers run side by side); the manifest."""
    from runtime_support import MXC, cpu_env

    done = subprocess.run([MXC, "compile", model, "--topology", "cpu-8", "--pin", "fsdp=8",
                           "--functions", "init,train_step", "-o", str(artifact), *extra],
                          env=cpu_env(8), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["topology"]["mesh"]["fsdp"] == 8, manifest["topology"]["mesh"]
    return manifest


def trains_and_resumes_bitwise(artifact, data, work, *, steps: int = 30, kill_after: int = 25) -> np.ndarray:
    """Trains `steps` steps from scratch, saving every 10; then a second run killed after step
    `kill_after` and started again, which must resume from its last save to the first run's losses
    and parameters bitwise (the data's position, images included, comes back with the checkpoint).
    Returns the first run's losses."""
    from runtime_support import cpu_env, read_metrics, restore_on_one_device, run_command, wait_for_step

    extra = ["--learning-rate", "1e-2", "--warmup-steps", "2", "--save-every", "10"]
    ref_metrics, ref_ckpt = work / "ref.jsonl", work / "ref_ckpt"
    done = subprocess.run(run_command(artifact, data, ref_ckpt, steps=steps, metrics=ref_metrics, extra=extra),
                          env=cpu_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    losses = np.array([r["loss"] for r in read_metrics(ref_metrics)])
    assert len(losses) == steps, losses

    metrics, ckpt = work / "killed.jsonl", work / "killed_ckpt"
    command = run_command(artifact, data, ckpt, steps=steps, metrics=metrics, extra=extra)
    process = subprocess.Popen(command, env=cpu_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_step(process, metrics, kill_after)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    done = subprocess.run(command, env=cpu_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and "resumed from step" in done.stderr, done.stderr[-4000:]
    assert [(r["step"], r["loss"]) for r in read_metrics(metrics)] == \
        [(r["step"], r["loss"]) for r in read_metrics(ref_metrics)]
    expected, resumed = restore_on_one_device(ref_ckpt, steps), restore_on_one_device(ckpt, steps)
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(resumed), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    return losses
