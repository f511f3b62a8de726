"""End to end through the `mxc` command line: a tiny Llama compiled for cpu-8, trained on text.

- `mxc run` for 60 steps: the loss falls, every metric is reported, and the training process
  loaded no compiler, spec or lark module.
- A run killed with SIGKILL near step 40 and started again resumes from its last checkpoint and
  ends bitwise equal (losses and parameters) to the uninterrupted run.
- SIGTERM saves the step under way and exits 0.
- `mxc generate ARTIFACT` decodes greedily as a full forward re-run per token does.
- Two processes of 4 devices each (jax.distributed, gloo on 127.0.0.1) give the 8-device losses.
"""

import json
import os
import signal
import subprocess

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import pytest

from runtime_support import (MXC, OPTIMIZER, PROMPT_LEN, PYTHON, STEPS, compile_tiny, corpus_files, cpu_env,
                             free_port, read_metrics, restore_on_one_device, run_command, tokenize, wait_for_step)

FORBIDDEN_PREFIXES = ("mxc.spec", "mxc.compiler", "lark")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("runtime_e2e")


@pytest.fixture(scope="module")
def artifact(workdir):
    return compile_tiny(workdir / "artifact")


@pytest.fixture(scope="module")
def tokens(workdir):
    return tokenize(corpus_files(), workdir / "tokens.bin")


@pytest.fixture(scope="module")
def reference(workdir, artifact, tokens):
    """The uninterrupted 60-step run: (metrics path, checkpoint dir, modules file, completed process)."""
    metrics, ckpt, modules = workdir / "ref.jsonl", workdir / "ref_ckpt", workdir / "modules.txt"
    done = subprocess.run(run_command(artifact, tokens, ckpt, metrics=metrics, extra=["--save-every", "20"]),
                          env=cpu_env(MXC_RUNTIME_MODULES_FILE=str(modules)), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return metrics, ckpt, modules, done


def test_sixty_steps_on_text_lower_the_loss(reference):
    metrics, ckpt, _, done = reference
    records = read_metrics(metrics)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for key in ("loss", "learning_rate", "grad_norm", "tokens_per_second", "step_seconds", "mfu", "tokens"):
        assert all(isinstance(r[key], float) and np.isfinite(r[key]) for r in records), key
    losses = np.array([r["loss"] for r in records])
    # A byte-level model starts near ln(512) = 6.24 nats and learns letter statistics fast.
    assert abs(losses[0] - np.log(512)) < 0.3
    assert losses[-10:].mean() < losses[:10].mean() - 1.0
    assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [20, 40, 60]
    assert "done: step 60" in done.stderr


def test_the_training_process_imports_no_compiler_code(reference):
    modules = reference[2].read_text().split()
    assert "mxc.runtime.loop" in modules and "jax" in modules
    leaked = [m for m in modules if m.startswith(FORBIDDEN_PREFIXES)]
    assert not leaked, leaked


def test_killed_run_resumes_bitwise(workdir, artifact, tokens, reference):
    ref_metrics, ref_ckpt, _, _ = reference
    metrics, ckpt = workdir / "killed.jsonl", workdir / "killed_ckpt"
    command = run_command(artifact, tokens, ckpt, metrics=metrics, extra=["--save-every", "10"])
    process = subprocess.Popen(command, env=cpu_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_step(process, metrics, 40)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    killed_at = read_metrics(metrics)[-1]["step"]
    assert killed_at < STEPS, "the run finished before it could be killed"
    done = subprocess.run(command, env=cpu_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "resumed from step" in done.stderr

    expected = [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(ref_metrics)]
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(metrics)] == expected
    reference_params = restore_on_one_device(ref_ckpt, STEPS)
    resumed_params = restore_on_one_device(ckpt, STEPS)
    flat_reference = dict(_flatten(reference_params))
    flat_resumed = dict(_flatten(resumed_params))
    assert flat_reference.keys() == flat_resumed.keys()
    for name, value in flat_reference.items():
        assert np.array_equal(value, flat_resumed[name]), name


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flatten(value, f"{prefix}/{key}")
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            yield from _flatten(value, f"{prefix}/{index}")
    else:
        yield prefix, np.asarray(tree)


def test_sigterm_saves_and_exits_cleanly(workdir, artifact, tokens):
    metrics, ckpt = workdir / "term.jsonl", workdir / "term_ckpt"
    process = subprocess.Popen(run_command(artifact, tokens, ckpt, steps=1000, metrics=metrics),
                               env=cpu_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_step(process, metrics, 5)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, stderr[-4000:]
    last = read_metrics(metrics)[-1]["step"]
    saved = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    assert saved == [last] and 5 <= last < 1000
    assert "signal received" in stderr


def test_generate_with_the_artifact_matches_the_full_forward_greedy_decode(workdir, artifact, reference):
    _, ckpt, _, _ = reference
    prompts = np.array([list(b"The "), list(b"def "), list(b"clas")], np.int32)
    assert prompts.shape[1] == PROMPT_LEN
    np.save(workdir / "prompts.npy", prompts)
    output = workdir / "generated.npy"
    done = subprocess.run([MXC, "generate", str(artifact), "--params", str(ckpt), "--prompt-tokens",
                           str(workdir / "prompts.npy"), "--max-new", "12", "--greedy", "-o", str(output)],
                          env=cpu_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "time to first token" in done.stderr and "tokens/s per user" in done.stderr
    generated = np.load(output)
    assert generated.shape == (3, PROMPT_LEN + 12)
    np.testing.assert_array_equal(generated[:, :PROMPT_LEN], prompts)
    expected, logits = _reference_greedy(ckpt, prompts, 12, output, workdir)
    # The artifact decodes over 8 devices, the reference on one: their bf16 sums round
    # differently, so where the two best next tokens are within rounding of each other either may
    # be chosen, and the rest of that row follows from it (seen: logits 0.0017 apart at 3.5).
    # Every token the artifact chose must be the reference's best up to that rounding, given the
    # same prefix (a wrong cache or position picks tokens logits apart), and all rows but one
    # must match token for token.
    chosen = np.take_along_axis(logits[:, PROMPT_LEN - 1:-1], generated[:, PROMPT_LEN:, None], axis=-1)[..., 0]
    best = logits[:, PROMPT_LEN - 1:-1].max(axis=-1)
    np.testing.assert_array_less(best - chosen, 1e-2 * np.maximum(1.0, np.abs(best)))
    assert sum(np.array_equal(g, e) for g, e in zip(generated, expected)) >= len(prompts) - 1, (generated, expected)


def _reference_greedy(ckpt, prompts, max_new, generated, workdir):
    """Greedy tokens by the full forward re-run per token (no cache, no generation driver) on the
    same parameters, one device, and its logits over the sequences in `generated` (teacher-forced)."""
    output = workdir / "reference_generated.npz"
    done = subprocess.run([PYTHON, os.path.join(os.path.dirname(__file__), "children", "reference_decode.py"),
                           str(ckpt.absolute()), str(STEPS),
                           str(workdir / "prompts.npy"), str(max_new), str(generated), str(output)],
                          env=cpu_env(PYTHONPATH=os.path.dirname(__file__)), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    found = np.load(output)
    return found["tokens"], found["logits"]


def test_two_processes_give_the_one_process_losses(workdir, artifact, tokens, reference):
    steps = 8
    processes = _two_process_run(artifact, tokens, workdir, "two", steps)
    try:
        errors = [p.communicate(timeout=300)[1] for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in processes] == [0, 0], errors
    expected = [r["loss"] for r in read_metrics(reference[0])[:steps]]
    losses = [r["loss"] for r in read_metrics(workdir / "two_0.jsonl")]
    # The same data, parameters and program; gloo's cross-process all-reduce may sum in another
    # order than XLA:CPU's in-process one, so equal up to float rounding, which the steps amplify:
    # 1.7e-5 relative by step 6 with CPU attention in query blocks (other data or another
    # initialisation would differ in the second digit).
    np.testing.assert_allclose(losses, expected, rtol=5e-5)
    assert not (workdir / "two_1.jsonl").exists()  # only process 0 writes metrics
    assert sorted(int(p.name) for p in (workdir / "two_ckpt").iterdir() if p.name.isdigit()) == [steps]


@pytest.mark.slow
def test_resume_onto_an_artifact_with_another_plan(workdir, artifact, tokens, reference):
    """A checkpoint of the fsdp=8 artifact resumed by an artifact compiled for data=2 x fsdp=2 x
    tensor=2: the arrays are resharded as they are read, and training goes on where it stopped."""
    import shutil

    other = compile_tiny(workdir / "artifact_2x2x2", pins=("data=2", "fsdp=2", "tensor=2"))
    mesh = json.loads((other / "manifest.json").read_text())["topology"]["mesh"]
    assert json.loads((artifact / "manifest.json").read_text())["topology"]["mesh"] != mesh
    ref_metrics, ref_ckpt, _, _ = reference
    ckpt = workdir / "reshard_ckpt"
    shutil.copytree(ref_ckpt, ckpt)
    shutil.rmtree(ckpt / str(STEPS))  # resume from step 40
    metrics = workdir / "reshard.jsonl"
    shutil.copy(ref_metrics, metrics)
    done = subprocess.run(run_command(other, tokens, ckpt, metrics=metrics), env=cpu_env(), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "resumed from step 40" in done.stderr
    expected = {r["step"]: r["loss"] for r in read_metrics(ref_metrics)}
    resumed = {r["step"]: r["loss"] for r in read_metrics(metrics)}
    assert sorted(resumed) == list(range(1, STEPS + 1))
    # Another layout sums in another order: the first step after the restore equals the
    # reference up to float rounding; each update then compounds the rounding (measured 1.6e-4
    # relative by step 60), far below what other parameters or data give (the second digit).
    # (1.5e-5 relative measured at step 41 with data 2 x fsdp 2 x tensor 2.)
    np.testing.assert_allclose(resumed[41], expected[41], rtol=5e-5)
    np.testing.assert_allclose([resumed[s] for s in range(42, STEPS + 1)],
                               [expected[s] for s in range(42, STEPS + 1)], rtol=1e-3)


def _two_process_run(artifact, tokens, workdir, name, steps):
    port = free_port()
    processes = []
    for process_id in range(2):
        command = [PYTHON, "-m", "mxc.runtime", "run", str(artifact), "--data", str(tokens), "--steps", str(steps),
                   "--ckpt-dir", str(workdir / f"{name}_ckpt"), "--metrics", str(workdir / f"{name}_{process_id}.jsonl"),
                   "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(process_id),
                   # The reference run's schedule (its defaults follow --steps).
                   "--warmup-steps", str(OPTIMIZER["warmup_steps"]), "--decay-steps", str(STEPS)]
        processes.append(subprocess.Popen(command, env=cpu_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                          text=True))
    return processes


@pytest.mark.slow
def test_sigterm_to_one_of_two_processes_stops_both_at_one_step(workdir, artifact, tokens):
    processes = _two_process_run(artifact, tokens, workdir, "term2", 1000)
    try:
        wait_for_step(processes[0], workdir / "term2_0.jsonl", 5)
        processes[0].send_signal(signal.SIGTERM)  # as a scheduler preempting one host would
        errors = [p.communicate(timeout=300)[1] for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in processes] == [0, 0], errors
    last = read_metrics(workdir / "term2_0.jsonl")[-1]["step"]
    assert sorted(int(p.name) for p in (workdir / "term2_ckpt").iterdir() if p.name.isdigit()) == [last]
