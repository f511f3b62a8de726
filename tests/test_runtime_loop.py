"""The training loop on its own, with a toy bigram model jitted in-process (no artifact): steps in
flight stay bounded, a resumed run equals an uninterrupted one, a non-finite loss stops the run
and keeps the last good checkpoint, evaluation and metrics lines."""

import json
import math
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mxc.runtime.checkpoint import Checkpoints
from mxc.runtime.loop import LoopConfig, NonFiniteLossError, StopSignal, TrainingRun
from mxc.runtime.metrics import MetricsLog, model_flops_utilisation
from mxc.runtime.token_file import open_tokens, write_tokens
from mxc.runtime.trainable import Trainable

from scheduled_bigram import single_device_trainable, table_init

VOCAB, BATCH, SEQ = 32, 4, 8


def _bigram_trainable(*, poison_at_step: int | None = None, flops_per_step=None, peak_flops=None) -> Trainable:
    """logits[t] = table[inputs[t]]; Adam. With `poison_at_step`, the update applied at that step
    turns the table to NaN, as a diverging run would."""
    optimizer = optax.adam(0.1)

    def loss_fn(params, batch):
        logits = params["table"][batch["inputs"]]
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
        mask = batch["mask"]
        return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0), mask

    @jax.jit
    def train_step(state, batch):
        (loss, mask), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], batch)
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        if poison_at_step is not None:
            params = jax.tree.map(lambda p: jnp.where(state["step"] + 1 >= poison_at_step, jnp.nan, p), params)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "learning_rate": jnp.float32(0.1),
                   "tokens": jnp.sum(mask)}
        return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

    @jax.jit
    def eval_step(params, batch):
        loss, mask = loss_fn(params, batch)
        return {"loss": loss, "accuracy": jnp.float32(0.0), "tokens": jnp.sum(mask)}

    return single_device_trainable(table_init(optimizer, VOCAB), train_step, eval_step, VOCAB,
                                   flops_per_step=flops_per_step, peak_flops=peak_flops, identity={"model": "bigram"})


@pytest.fixture
def tokens(tmp_path):
    rng = np.random.default_rng(0)
    # A learnable stream: each token mostly follows its predecessor + 1; documents end with 31.
    stream, token = [], 0
    for _ in range(3000):
        token = (token + 1) % 31 if rng.random() < 0.9 else int(rng.integers(0, 31))
        stream.append(token)
        if rng.random() < 0.05:
            stream.append(31)
    write_tokens(tmp_path / "t.bin", [np.array(stream)], vocab_size=VOCAB, eod_id=31, tokenizer="test")
    return open_tokens(tmp_path / "t.bin")


def _run(trainable, tokens, directory, config, **kwargs):
    run = TrainingRun(trainable, tokens, Checkpoints(directory, keep=None), config, **kwargs)
    try:
        with StopSignal(multi_process=False) as stop:
            return run, run.run(stop)
    finally:
        run.close()


def _lines(path, kind="train"):
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == kind]


def test_loss_falls_and_metrics_lines_are_complete(tmp_path, tokens):
    trainable = _bigram_trainable(flops_per_step=1e6, peak_flops=1e9)
    metrics = tmp_path / "m.jsonl"
    _, summary = _run(trainable, tokens, tmp_path / "ckpt", LoopConfig(steps=30, progress=False), metrics_path=metrics)
    records = _lines(metrics)
    assert [r["step"] for r in records] == list(range(1, 31)) and summary.last_step == 30
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    for record in records:
        assert record["tokens_per_second"] == pytest.approx(BATCH * SEQ / record["step_seconds"])
        assert record["cpu_seconds"] > 0  # the process's CPU time over the step
        assert record["mfu"] == pytest.approx(1e6 / record["step_seconds"] / 1e9)
    assert Checkpoints(tmp_path / "ckpt").all_steps() == [30]  # saved at the end


def test_steps_in_flight_stay_bounded(tmp_path, tokens):
    trainable = _bigram_trainable()
    dispatched, reported, most_ahead = [0], [0], [0]

    def counting_step(state, batch):
        dispatched[0] += 1
        most_ahead[0] = max(most_ahead[0], dispatched[0] - reported[0])
        return trainable.train_step(state, batch)

    class CountingRun(TrainingRun):
        def _report(self, step, metrics, *seconds):
            reported[0] += 1
            return super()._report(step, metrics, *seconds)

    counting = Trainable(**{**trainable.__dict__, "train_step": counting_step})
    run = CountingRun(counting, tokens, Checkpoints(tmp_path / "ckpt"), LoopConfig(steps=25, in_flight=3, progress=False))
    with StopSignal(multi_process=False) as stop:
        run.run(stop)
    run.close()
    assert reported[0] == 25 and most_ahead[0] == 3


def test_resuming_rewrites_the_metrics_and_matches_an_uninterrupted_run(tmp_path, tokens):
    config = LoopConfig(steps=20, save_every=6, progress=False)
    _run(_bigram_trainable(), tokens, tmp_path / "whole", config, metrics_path=tmp_path / "whole.jsonl")

    # A run that died after step 14 with its last checkpoint at 12: keep only that checkpoint,
    # and the metrics it had written up to 14 (plus a line cut in half by the crash).
    _run(_bigram_trainable(), tokens, tmp_path / "part", LoopConfig(steps=14, save_every=6, progress=False),
         metrics_path=tmp_path / "part.jsonl")
    import shutil
    shutil.rmtree(tmp_path / "part" / "14")
    with open(tmp_path / "part.jsonl", "a") as f:
        f.write('{"step": 15, "kind": "tr')
    run, summary = _run(_bigram_trainable(), tokens, tmp_path / "part", config, metrics_path=tmp_path / "part.jsonl")
    assert summary.first_step == 12
    whole, resumed = _lines(tmp_path / "whole.jsonl"), _lines(tmp_path / "part.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, 21))
    assert [(r["loss"], r["grad_norm"]) for r in resumed] == [(r["loss"], r["grad_norm"]) for r in whole]
    a = Checkpoints(tmp_path / "whole").restore(20, params_target=run.trainable.abstract_state["params"],
                                                optimizer_target={"step": run.trainable.abstract_state["step"],
                                                                  "opt_state": run.trainable.abstract_state["opt_state"]})
    b = Checkpoints(tmp_path / "part").restore(20, params_target=run.trainable.abstract_state["params"],
                                               optimizer_target={"step": run.trainable.abstract_state["step"],
                                                                 "opt_state": run.trainable.abstract_state["opt_state"]})
    np.testing.assert_array_equal(np.asarray(a[0]["table"]), np.asarray(b[0]["table"]))
    assert a[2]["data"] == b[2]["data"] and a[2]["data"]["consumed"] == 20 * BATCH


def test_a_corrupt_newest_step_stops_the_run_unless_the_user_asks_for_the_intact_one(tmp_path, tokens):
    """Issue 22: never resume from a corrupt step; --fallback takes the newest intact one."""
    import shutil

    from mxc.runtime.checkpoint import CheckpointError

    _run(_bigram_trainable(), tokens, tmp_path / "ckpt", LoopConfig(steps=12, save_every=6, progress=False))
    shutil.rmtree(tmp_path / "ckpt" / "12" / "optimizer")  # a lost or truncated item
    with pytest.raises(CheckpointError, match=r"step 12 cannot be read.*--fallback"):
        _run(_bigram_trainable(), tokens, tmp_path / "ckpt", LoopConfig(steps=14, progress=False))
    _, summary = _run(_bigram_trainable(), tokens, tmp_path / "ckpt",
                      LoopConfig(steps=14, progress=False, fallback=True))
    assert summary.first_step == 6


def test_a_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, tokens):
    # The update of step 7 writes NaN into the parameters; step 8's loss is the first NaN.
    trainable = _bigram_trainable(poison_at_step=7)
    metrics = tmp_path / "m.jsonl"
    with pytest.raises(NonFiniteLossError, match=r"step 8: loss nan.*last good checkpoint is step 5"):
        _run(trainable, tokens, tmp_path / "ckpt", LoopConfig(steps=20, save_every=5, progress=False),
             metrics_path=metrics)
    assert Checkpoints(tmp_path / "ckpt").all_steps() == [5]
    assert [r["step"] for r in _lines(metrics)] == list(range(1, 8))


def test_evaluation_every_k_steps_and_at_the_end(tmp_path, tokens):
    metrics = tmp_path / "m.jsonl"
    _run(_bigram_trainable(), tokens, tmp_path / "ckpt",
         LoopConfig(steps=10, eval_every=4, eval_batches=2, progress=False), metrics_path=metrics, eval_data=tokens)
    evals = _lines(metrics, "eval")
    assert [r["step"] for r in evals] == [4, 8, 10]
    assert all(r["tokens"] > 0 and math.isfinite(r["loss"]) for r in evals)
    assert evals[-1]["loss"] < evals[0]["loss"]


def test_a_finished_run_does_nothing_more(tmp_path, tokens):
    _run(_bigram_trainable(), tokens, tmp_path / "ckpt", LoopConfig(steps=5, progress=False))
    _, summary = _run(_bigram_trainable(), tokens, tmp_path / "ckpt", LoopConfig(steps=5, progress=False))
    assert (summary.first_step, summary.last_step) == (5, 5)


def test_mfu_and_non_finite_numbers_in_json(tmp_path):
    assert model_flops_utilisation(2e12, 0.5, 1e13) == pytest.approx(0.4)
    assert model_flops_utilisation(None, 0.5, 1e13) is None
    log = MetricsLog(tmp_path / "m.jsonl")
    log.write({"step": 1, "loss": float("nan"), "grad_norm": float("inf")})
    log.close()
    # Strict JSON (no bare NaN token) that still says what happened.
    record = json.loads((tmp_path / "m.jsonl").read_text(), parse_constant=lambda name: pytest.fail(name))
    assert record == {"step": 1, "loss": "nan", "grad_norm": "inf"}


def test_init_from_starts_a_fresh_run_from_saved_parameters(tmp_path, tokens):
    first, _ = _run(_bigram_trainable(), tokens, tmp_path / "first", LoopConfig(steps=6, progress=False))
    trained = np.asarray(first.state["params"]["table"])
    second = TrainingRun(_bigram_trainable(), tokens, Checkpoints(tmp_path / "second"),
                         LoopConfig(steps=3, seed=5, progress=False), init_from=tmp_path / "first")
    try:
        assert second.first_step == 0 and int(second.state["step"]) == 0  # a new run: step and optimizer fresh
        np.testing.assert_array_equal(np.asarray(second.state["params"]["table"]), trained)
        assert float(jnp.abs(jax.tree.leaves(second.state["opt_state"])[1]).sum()) == 0.0  # Adam moments at zero
    finally:
        second.close()
