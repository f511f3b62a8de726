"""The learning-rate schedule `mxc run` computes every step: its values against optax's own
schedules, its defaults from --steps and the artifact, and how a resume keeps or changes it."""

import math

import optax
import pytest

from mxc.runtime.schedule import Schedule, ScheduleError, ScheduleRequest

STEPS = (0, 1, 4, 5, 6, 17, 30, 59, 60, 61, 200)


def _optax_reference(schedule: Schedule) -> optax.Schedule:
    """The same schedule built from optax's pieces, independently of runtime/schedule.py."""
    peak, floor, warmup, decay = schedule.peak, schedule.floor, schedule.warmup_steps, schedule.decay_steps
    warm = optax.linear_schedule(0.0, peak, warmup)
    if schedule.kind == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, decay, end_value=floor)
    if schedule.kind == "linear":
        return optax.join_schedules([warm, optax.linear_schedule(peak, floor, decay - warmup)], [warmup])
    if schedule.kind == "constant":
        return optax.join_schedules([warm, optax.constant_schedule(peak)], [warmup])
    decaying = round(schedule.decay_fraction * decay)
    return optax.join_schedules(
        [warm, optax.constant_schedule(peak), optax.linear_schedule(peak, floor, decaying)],
        [warmup, decay - decaying])


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant", "wsd"])
def test_schedule_values_match_optax(kind):
    schedule = Schedule(kind, peak=3e-3, warmup_steps=5, decay_steps=60, min_ratio=0.1, decay_fraction=0.2)
    reference = _optax_reference(schedule)
    for step in STEPS:
        assert schedule.rate(step) == pytest.approx(float(reference(step)), rel=1e-5, abs=1e-12), (kind, step)


def test_wsd_holds_the_peak_then_decays_in_its_last_fraction():
    schedule = Schedule("wsd", peak=1.0, warmup_steps=10, decay_steps=100, min_ratio=0.0, decay_fraction=0.2)
    assert schedule.wsd_decay_start == 80
    assert schedule.rate(10) == schedule.rate(79) == 1.0
    assert schedule.rate(90) == pytest.approx(0.5) and schedule.rate(100) == 0.0 == schedule.rate(150)


def test_no_warmup_starts_at_the_peak():
    assert Schedule("cosine", peak=2e-3, warmup_steps=0, decay_steps=10).rate(0) == pytest.approx(2e-3)


def test_inputs_are_a_float32_scalar_of_the_rate():
    schedule = Schedule("linear", peak=1e-3, warmup_steps=4, decay_steps=8)
    value = schedule.inputs(2)["learning_rate"]
    assert value.dtype.name == "float32" and value.shape == () and float(value) == pytest.approx(5e-4)


ARTIFACT = {"learning_rate": 3e-4, "total_steps": 10_000, "warmup_steps": None, "min_lr_ratio": 0.1}


def test_defaults_follow_the_steps_and_the_artifact():
    fresh = ScheduleRequest(steps=60, artifact_optimizer=ARTIFACT).fresh()
    # The artifact's warmup (a tenth of 10,000) is cut to a tenth of this run; decay over the run.
    assert fresh == Schedule("cosine", peak=3e-4, warmup_steps=6, decay_steps=60, min_ratio=0.1)
    short_warmup = ScheduleRequest(steps=60, artifact_optimizer={**ARTIFACT, "warmup_steps": 3}).fresh()
    assert short_warmup.warmup_steps == 3
    given = ScheduleRequest(steps=60, artifact_optimizer=ARTIFACT, kind="wsd", peak=1e-2, warmup_steps=100).fresh()
    assert (given.kind, given.peak, given.warmup_steps, given.decay_steps) == ("wsd", 1e-2, 100, 100)


def test_a_resume_keeps_the_stored_schedule_and_names_what_flags_change():
    stored = Schedule("cosine", peak=3e-3, warmup_steps=5, decay_steps=60).to_json()
    # Resumed with a longer --steps and no schedule flags: the same schedule, nothing to say.
    same, changes = ScheduleRequest(steps=100, artifact_optimizer=ARTIFACT).resumed(stored)
    assert same == Schedule.from_json(stored) and changes == []
    changed, changes = ScheduleRequest(steps=100, artifact_optimizer=ARTIFACT, decay_steps=100,
                                       peak=1e-3).resumed(stored)
    assert changed.decay_steps == 100 and changed.peak == 1e-3
    assert changes == ["peak 0.003 -> 0.001", "decay_steps 60 -> 100"]


@pytest.mark.parametrize("flags, message", [
    ({"decay_fraction": 0.2}, "--decay-fraction applies to --schedule wsd only, not cosine"),
    ({"kind": "constant", "decay_steps": 50}, "--decay-steps does not apply to --schedule constant"),
    ({"kind": "constant", "min_ratio": 0.0}, "--min-lr-ratio does not apply to --schedule constant"),
])
def test_flags_that_do_not_apply_to_the_schedule_are_refused(flags, message):
    request = ScheduleRequest(steps=60, artifact_optimizer=ARTIFACT, **flags)
    with pytest.raises(ScheduleError, match=message):
        request.fresh()
    with pytest.raises(ScheduleError, match=message):
        request.resumed(Schedule("cosine", 1e-3, 5, 60).to_json())


@pytest.mark.parametrize("settings, flag", [
    ({"kind": "step"}, "--schedule"),
    ({"peak": 0.0}, "--learning-rate"),
    ({"peak": math.nan}, "--learning-rate"),
    ({"warmup_steps": -1}, "--warmup-steps"),
    ({"decay_steps": 3}, "--decay-steps 3 ends before --warmup-steps 5"),
    ({"min_ratio": 1.5}, "--min-lr-ratio"),
    ({"decay_fraction": 0.0}, "--decay-fraction"),
])
def test_bad_settings_name_their_flag(settings, flag):
    with pytest.raises(ScheduleError, match=flag):
        Schedule(**{"kind": "cosine", "peak": 1e-3, "warmup_steps": 5, "decay_steps": 60, **settings})


# ------------------------------------------------------------------ the train step takes the rate

def test_the_train_step_applies_the_rate_it_is_given_as_optax_adamw_would():
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mxc.compiler.lower.loss import loss_sums
    from mxc.compiler.lower.optimizer import OptimizerConfig, learning_rate_schedule, make_optimizer
    from mxc.compiler.lower.train import TrainState, make_gradient_step

    config = OptimizerConfig(learning_rate=1.0, warmup_steps=5, total_steps=10, weight_decay=0.1, clip_norm=0.5)
    params = {"table": jax.random.normal(jax.random.key(0), (8, 8))}
    batch = {"inputs": jnp.arange(16).reshape(2, 8) % 8, "targets": (jnp.arange(16).reshape(2, 8) + 1) % 8,
             "mask": jnp.ones((2, 8))}

    def sums(p, b):
        return loss_sums(p["table"][b["inputs"]], b["targets"], b["mask"])

    optimizer = make_optimizer(config)
    step = jax.jit(make_gradient_step(sums, optimizer, learning_rate_schedule(config)))
    state = TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))
    new, metrics = step(state, batch, jnp.float32(0.02))
    # The schedule baked into the config would give 0 at step 0: the given rate is what counts.
    assert float(metrics["learning_rate"]) == pytest.approx(0.02)
    reference = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(0.02, b1=config.b1, b2=config.b2,
                                                                          eps=config.eps, weight_decay=0.1))
    grads = jax.grad(lambda p: sums(p, batch).total() / 16.0)(params)
    updates, _ = reference.update(grads, reference.init(params), params)
    np.testing.assert_allclose(new.params["table"], optax.apply_updates(params, updates)["table"], rtol=1e-5,
                               atol=1e-7)


# ------------------------------------------------------------------ the loop feeds and stores it

import json  # noqa: E402

from scheduled_bigram import ARTIFACT_OPTIMIZER, scheduled_bigram  # noqa: E402
from test_runtime_loop import tokens  # noqa: E402,F401  (the fixture: a learnable token stream)

from mxc.runtime.checkpoint import Checkpoints  # noqa: E402
from mxc.runtime.loop import LoopConfig, StopSignal, TrainingRun  # noqa: E402


def _train(directory, data, steps, metrics, **flags):
    request = ScheduleRequest(steps=steps, artifact_optimizer=ARTIFACT_OPTIMIZER, **flags)
    run = TrainingRun(scheduled_bigram(), data, Checkpoints(directory, keep=None),
                      LoopConfig(steps=steps, progress=True, log_every=100), metrics_path=metrics, schedule=request)
    try:
        with StopSignal(multi_process=False) as stop:
            run.run(stop)
    finally:
        run.close()
    return run


def _train_lines(path):
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == "train"]


def test_a_run_stopped_mid_warmup_resumes_the_same_schedule(tmp_path, tokens, capsys):  # noqa: F811
    whole = _train(tmp_path / "whole", tokens, 12, tmp_path / "whole.jsonl", warmup_steps=6)
    assert whole.schedule == Schedule("cosine", 0.05, 6, 12, 0.1)
    # The same schedule, stopped at step 4 of the 6-step warmup, then resumed with no schedule flags.
    _train(tmp_path / "part", tokens, 4, tmp_path / "part.jsonl", warmup_steps=6, decay_steps=12)
    assert "warning: --steps 4 ends before the warmup does (step 6)" in capsys.readouterr().err
    resumed = _train(tmp_path / "part", tokens, 12, tmp_path / "part.jsonl")
    assert "schedule changed" not in capsys.readouterr().err
    assert resumed.first_step == 4 and resumed.schedule == whole.schedule
    expected = [(r["step"], r["learning_rate"], r["loss"]) for r in _train_lines(tmp_path / "whole.jsonl")]
    assert [(r["step"], r["learning_rate"], r["loss"]) for r in _train_lines(tmp_path / "part.jsonl")] == expected
    # Each update used the schedule's rate (the first, at step 0 of the warmup, none).
    rates = [r["learning_rate"] for r in _train_lines(tmp_path / "whole.jsonl")]
    assert rates == pytest.approx([whole.schedule.rate(step) for step in range(12)], rel=1e-6, abs=1e-12)
    meta = Checkpoints(tmp_path / "part").read_meta(12)
    assert Schedule.from_json(meta["schedule"]) == whole.schedule


def test_flags_on_resume_change_the_schedule_with_a_notice(tmp_path, tokens, capsys):  # noqa: F811
    _train(tmp_path / "run", tokens, 4, tmp_path / "m.jsonl", warmup_steps=2, decay_steps=10)
    capsys.readouterr()
    resumed = _train(tmp_path / "run", tokens, 8, tmp_path / "m.jsonl", kind="constant")
    err = capsys.readouterr().err
    assert "schedule changed on resume: kind cosine -> constant" in err
    assert resumed.schedule.kind == "constant"
    assert [r["learning_rate"] for r in _train_lines(tmp_path / "m.jsonl")][4:] == pytest.approx([0.05] * 4)


# ------------------------------------------------------------------ artifacts from before

def _stand_in_artifact(directory, format_version=None):
    """An artifact directory whose manifest checks (no functions): enough for `mxc run` to read
    its format and topology and to refuse what comes before loading executables."""
    from mxc.compiler.artifact_writer import write_artifact
    from mxc.runtime.artifact import FORMAT_VERSION, Manifest, manifest_digest

    manifest = Manifest.model_validate({
        "format_version": FORMAT_VERSION, "model": "llama3-tiny", "spec": {}, "spec_hash": "0" * 64,
        "plan": {}, "run": {"optimizer": ARTIFACT}, "functions": {}, "files": {},
        "topology": {"name": "cpu-8", "platform": "cpu", "chip": "cpu", "device_kind": "cpu", "chips": 8,
                     "devices": 8, "hbm_bytes": 0, "shape": [8], "mesh": {"fsdp": 8}, "device_ids": list(range(8))},
        "versions": {"jax": "0", "jaxlib": "0", "libtpu": None, "mxc": "0"}})
    write_artifact(directory, manifest, {"train_step.executable": b"x"})
    if format_version is not None:
        data = json.loads((directory / "manifest.json").read_text())
        data["format_version"] = format_version
        data["manifest_sha256"] = manifest_digest(data)
        (directory / "manifest.json").write_text(json.dumps(data))
    return directory


def _mxc_run(artifact, tmp_path, *flags):
    import subprocess

    from runtime_support import MXC, cpu_env

    return subprocess.run([MXC, "run", str(artifact), "--data", str(tmp_path / "tokens.bin"), "--steps", "1",
                           "--ckpt-dir", str(tmp_path / "ckpt"), *flags], env=cpu_env(), capture_output=True,
                          text=True, timeout=120)


def _one_error_line(done) -> str:
    assert done.returncode == 1 and done.stderr.startswith("mxc: error: "), done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    return done.stderr


def test_an_artifact_whose_train_step_baked_in_its_schedule_is_refused_with_recompile(tmp_path):
    """Format 3 train steps took (state, batch) and scheduled themselves: `mxc run` refuses them
    in one line that says to recompile, before loading anything."""
    from mxc.runtime.artifact import FORMAT_VERSION

    old = _stand_in_artifact(tmp_path / "old", format_version=3)
    err = _one_error_line(_mxc_run(old, tmp_path))
    assert f"artifact format 3, which this mxc no longer reads: expected format {FORMAT_VERSION}" in err
    assert f"recompile it: mxc compile MODEL ... -o {old} --force" in err
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("flags, message", [
    (["--warmup-steps", "10", "--decay-steps", "5"], "--decay-steps 5 ends before --warmup-steps 10 does"),
    (["--profile-steps", "2:3"], "--profile-steps needs a directory for its trace"),
])
def test_bad_schedule_and_profile_flags_are_one_error_line(tmp_path, flags, message):
    err = _one_error_line(_mxc_run(_stand_in_artifact(tmp_path / "artifact"), tmp_path, *flags))
    assert message in err and not (tmp_path / "ckpt").exists()
