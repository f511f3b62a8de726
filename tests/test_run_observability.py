"""What a training user sees: TensorBoard scalars for every metric (read back from the event files
with tensorboardX's own record format and protobufs), a JAX profiler trace of chosen steps that
XProf's converter opens, eval loss and perplexity on the console, and the end-of-run summary.
The loop runs in a child process (tests/children/observed_run.py) on a toy model trained by the
real lowering's optimizer."""

import json
import math
import re
import struct
import subprocess
from pathlib import Path

import pytest

from runtime_support import child, cpu_env
from scheduled_bigram import BATCH, SEQ

from mxc.runtime.metrics import RunTotals
from mxc.runtime.profiling import ProfileStepsError, ProfileWindow

STEPS = 6  # as tests/children/observed_run.py runs


def read_event_files(directory) -> list:
    """Every Event of every events file under `directory`, checking the TFRecord framing (length
    and data CRCs) as TensorBoard's reader does, parsed with tensorboardX's Event protobuf."""
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.record_writer import masked_crc32c

    events = []
    for path in sorted(directory.rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            header = data[offset:offset + 8]
            (length,) = struct.unpack("<Q", header)
            (length_crc,) = struct.unpack("<I", data[offset + 8:offset + 12])
            assert length_crc == masked_crc32c(header), path
            body = data[offset + 12:offset + 12 + length]
            (body_crc,) = struct.unpack("<I", data[offset + 12 + length:offset + 16 + length])
            assert body_crc == masked_crc32c(body), path
            event = Event()
            event.ParseFromString(body)
            events.append(event)
            offset += 16 + length
    return events


def scalars(events) -> dict:
    """{tag: {step: value}} of the scalar summaries among `events`."""
    found: dict = {}
    for event in events:
        for value in event.summary.value:
            found.setdefault(value.tag, {})[event.step] = value.simple_value
    return found


def trace_events(xplane) -> list[dict]:
    """The trace viewer's events of an XSpace file, converted by XProf (as its UI does)."""
    from xprof.convert import raw_to_tool_data

    text, content_type = raw_to_tool_data.xspace_to_tool_data([str(xplane)], "trace_viewer", {})
    assert content_type == "application/json"
    return json.loads(text)["traceEvents"]


@pytest.fixture(scope="module")
def observed_run(tmp_path_factory):
    """The child's 6-step run with evaluation every 3 steps, TensorBoard and a trace of steps 2-3:
    (its folder, its totals and summary lines, metrics records, what it printed)."""
    directory = tmp_path_factory.mktemp("observed")
    done = subprocess.run(child("observed_run", directory), env=cpu_env(PYTHONPATH=str(Path(__file__).parent)),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    records = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    return directory, json.loads(done.stdout.strip().splitlines()[-1]), records, done.stderr


def test_tensorboard_holds_every_metric_of_every_line(observed_run):
    directory, _, records, _ = observed_run
    found = scalars(read_event_files(directory / "tb"))
    expected: dict = {}
    for record in records:
        for name, value in record.items():
            if name not in ("step", "kind", "time") and isinstance(value, (int, float)):
                expected.setdefault(f"{record['kind']}/{name}", {})[record["step"]] = value
    assert {"train/loss", "train/learning_rate", "train/grad_norm", "train/tokens_per_second", "train/mfu",
            "eval/loss", "eval/perplexity", "eval/accuracy"} <= set(expected)
    assert set(found) == set(expected)
    for tag, values in expected.items():
        assert found[tag] == pytest.approx(values, rel=1e-6), tag  # float32 in the event file
    assert sorted(found["eval/perplexity"]) == [3, 6]


def test_the_profile_trace_holds_the_chosen_steps_and_xprof_opens_it(observed_run):
    directory, _, _, err = observed_run
    traces = sorted((directory / "profile").rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].parent.parent.name == "profile"  # plugins/profile/<run>/
    assert f"profile of steps 2-3: {traces[0]}" in err
    events = trace_events(traces[0])
    # The loop's step markers (jax.profiler.StepTraceAnnotation), as XProf names them.
    assert {event["name"] for event in events if re.fullmatch(r"train \d+", event.get("name", ""))} \
        == {"train 2", "train 3"}
    assert any(event.get("name") == "PjitFunction(train_step)" for event in events)  # the step itself


def test_eval_loss_and_perplexity_on_the_console_and_the_summary(observed_run):
    _, summary, records, err = observed_run
    evals = [r for r in records if r["kind"] == "eval"]
    for record in evals:
        assert record["perplexity"] == pytest.approx(math.exp(record["loss"]))
        assert f"eval at step {record['step']}: loss {record['loss']:.4f}, perplexity {record['perplexity']:.2f}" in err
    train_seconds = sum(r["step_seconds"] for r in records if r["kind"] == "train")
    assert summary["steps"] == STEPS and summary["tokens"] == STEPS * BATCH * SEQ
    assert summary["train_seconds"] == pytest.approx(train_seconds)
    assert summary["wall_seconds"] >= train_seconds
    lines = summary["lines"]
    assert lines[0].startswith(f"tokens seen {STEPS * BATCH * SEQ:,} in {STEPS} steps; wall time ")
    assert f"mean {STEPS * BATCH * SEQ / train_seconds:,.0f} tokens/s" in lines[0]
    assert lines[1] == f"MFU {100 * 1e6 * STEPS / train_seconds / 1e9:.2f}% of a peak of 1e+09 FLOP/s"
    best = min(evals, key=lambda r: r["loss"])
    assert lines[2] == (f"eval loss: final {evals[-1]['loss']:.4f} (step 6, perplexity {evals[-1]['perplexity']:.2f}), "
                        f"best {best['loss']:.4f} (step {best['step']})")


def test_a_summary_without_a_peak_says_so():
    totals = RunTotals(tokens_per_step=32, flops_per_step=1e6, peak_flops=None)
    totals.add_train({"step_seconds": 0.5})
    assert totals.summary_lines(1.0)[1].startswith("MFU unknown")


@pytest.mark.parametrize("text", ["3", "0:2", "5:4", "a:b", "1:2:3"])
def test_profile_steps_must_name_a_window(text, tmp_path):
    if text == "3":
        assert ProfileWindow.parse(text, tmp_path) == ProfileWindow(3, 3, tmp_path)
        return
    with pytest.raises(ProfileStepsError, match="expected K:N"):
        ProfileWindow.parse(text, tmp_path)
