"""The training loop: resume or start, step with a bounded window in flight, report, checkpoint, stop.

Steps in flight. jax dispatches asynchronously, so the host could queue hundreds of steps
ahead of the devices; on XLA:CPU about a hundred unsynchronised programs with collectives
deadlock its rendezvous. The loop keeps at most `in_flight` steps queued and blocks on the
oldest step's metrics before dispatching more (2 keeps the next batch's host work overlapped
with the running step).

Stopping. SIGTERM or SIGINT (a preempted or interrupted job) finishes the step under way,
saves, waits for the save and returns normally, so the process exits 0. With several processes
they must agree on the step to stop at: jax's preemption sync point does that (jax.distributed
notices SIGTERM itself; SIGINT is turned into a SIGTERM to reach the same path).

A failed save (disk full, a file too large) stops the run at the next step boundary with a
SaveError naming the step and folder; the steps saved before it stay intact.

Resuming refuses a checkpoint trained with another spec (read from the step's meta before its
arrays); --init-from refuses only parameters of other shapes, since fine-tuning starts from
another run's parameters by design.

A non-finite loss or gradient norm stops the run without saving: a checkpoint is only taken
once the loss and gradient norm of every step up to it were seen to be finite, so the newest
checkpoint is the last state known to be good.

The learning rate. With a ScheduleRequest (an artifact's train step takes its rate as an input)
the loop computes each update's rate (mxc.runtime.schedule) and stores the schedule in every
checkpoint's meta; a resumed run continues the stored schedule, changed only where the resuming
command's flags say so (with a one-line notice naming the changes).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass

import jax
import numpy as np

from mxc.runtime.artifact import ArtifactError
from mxc.runtime.checkpoint import CheckpointError, Checkpoints, SpecMismatchError, restore_params
from mxc.runtime.data import TrainData, eval_batches
from mxc.runtime.metrics import MetricsLog, ProgressDisplay, RunTotals, model_flops_utilisation, perplexity
from mxc.runtime.profiling import ProfileWindow, StepProfiler
from mxc.runtime.schedule import Schedule, ScheduleRequest
from mxc.runtime.token_file import TokenFile
from mxc.runtime.trainable import Trainable


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became NaN or infinite; the message names the step and the
    checkpoint that remains."""


@dataclass(frozen=True)
class LoopConfig:
    steps: int  # train until the state's step reaches this
    save_every: int | None = None  # None: only at the end and on a signal
    eval_every: int | None = None
    eval_batches: int = 4
    seed: int = 0  # initialisation and data order (a resumed run keeps the checkpoint's)
    in_flight: int = 2
    log_every: int = 10
    progress: bool = True
    fallback: bool = False  # resume from the newest intact step when newer ones are corrupt
    doc_mask: bool = True  # segment ids and positions per document (data.py), where the file marks them


@dataclass(frozen=True)
class RunSummary:
    first_step: int  # the step the run started from (0, or the checkpoint resumed)
    last_step: int  # the step the state reached
    stopped_by_signal: bool
    last_loss: float | None
    totals: RunTotals | None = None  # what this invocation trained and evaluated
    wall_seconds: float = 0.0


def scalar(value) -> float:
    """A replicated scalar as a float, read from this process's own copy (works multi-host)."""
    if isinstance(value, jax.Array):
        value = value.addressable_data(0)
    return float(np.asarray(value))


class StopSignal:
    """Remembers a SIGTERM/SIGINT until the loop reaches a step boundary."""

    def __init__(self, multi_process: bool):
        self.multi_process = multi_process
        self.received: int | None = None
        self._previous = {}

    def __enter__(self):
        if self.multi_process:
            # jax.distributed's preemption notifier owns SIGTERM; route SIGINT to it.
            self._install(signal.SIGINT, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
        else:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._install(sig, self._note)
        return self

    def _install(self, sig, handler):
        self._previous[sig] = signal.signal(sig, handler)

    def _note(self, signum, _frame):
        self.received = signum

    def should_stop(self, step: int) -> bool:
        if self.multi_process:
            from jax.experimental import multihost_utils

            return multihost_utils.reached_preemption_sync_point(step)
        return self.received is not None

    def __exit__(self, *_):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _optimizer_item(state: dict) -> dict:
    return {"step": state["step"], "opt_state": state["opt_state"]}


class TrainingRun:
    """One invocation of `mxc run`: owns the state, the data position and the checkpoints."""

    def __init__(self, trainable: Trainable, data: TokenFile, checkpoints: Checkpoints, config: LoopConfig, *,
                 metrics_path=None, eval_data: TokenFile | None = None, init_from=None, primary: bool = True,
                 schedule: ScheduleRequest | None = None, tensorboard_dir=None, profile: ProfileWindow | None = None):
        """`schedule`: the train step takes its learning rate as a third argument, computed from
        this request (None: the train step takes (state, batch) and schedules itself)."""
        self.trainable, self.checkpoints, self.config = trainable, checkpoints, config
        self.primary = primary
        self.schedule: Schedule | None = None
        self._schedule_changes: list[str] = []
        self.tensorboard = None
        try:
            self.data = TrainData(data, trainable.layout, seed=config.seed, vocab_size=trainable.vocab_size,
                                  doc_mask=config.doc_mask)
            self.eval_data = eval_data
            if eval_data is not None and trainable.eval_step is None:
                raise ArtifactError("--eval-data needs an artifact with an eval_step function")
            self.state, self.first_step, stored_schedule = self._start(init_from)
            if schedule is not None:
                if self.first_step:
                    self.schedule, self._schedule_changes = schedule.resumed(stored_schedule)
                else:
                    self.schedule = schedule.fresh()
            if tensorboard_dir is not None and primary:
                from mxc.runtime.tensorboard import TensorBoardLog

                self.tensorboard = TensorBoardLog(tensorboard_dir,
                                                  resume_after_step=self.first_step if self.first_step else None)
        except BaseException:
            checkpoints.close()  # releases the lock and removes a folder it created for nothing
            raise
        self.metrics = MetricsLog(metrics_path if primary else None,
                                  resume_after_step=self.first_step if self.first_step else None)
        self.progress = ProgressDisplay(config.steps, self.first_step, enabled=primary and config.progress,
                                        log_every=config.log_every)
        self.profiler = StepProfiler(profile)
        layout = trainable.layout
        self.totals = RunTotals(layout.batch * layout.seq, trainable.flops_per_step, trainable.peak_flops)

    def _start(self, init_from) -> tuple[dict, int, dict | None]:
        """(train state, its step, the schedule its checkpoint stored: None when fresh)."""
        abstract = self.trainable.abstract_state
        steps = sorted(self.checkpoints.all_steps(), reverse=True)
        for step in steps:
            try:
                params, optimizer, meta = self.checkpoints.restore(
                    step, params_target=abstract["params"], optimizer_target=_optimizer_item(abstract),
                    identity=self.trainable.identity)
            except SpecMismatchError:
                raise  # another model: no older step of this folder fits either
            except CheckpointError as err:
                # Never from a corrupt step; from an older intact one only when the user said so.
                if not self.config.fallback:
                    raise CheckpointError(f"{err}; --fallback resumes from the newest intact step instead") from None
                if self.primary:
                    print(f"mxc run: {err}; trying the step before it (--fallback)", file=sys.stderr, flush=True)
                continue
            self.data.restore(meta["data"])
            state = {"step": optimizer["step"], "params": params, "opt_state": optimizer["opt_state"]}
            return state, step, meta.get("schedule")
        if steps:
            raise CheckpointError(f"no intact checkpoint in {self.checkpoints.directory} (steps {steps} are all corrupt)")
        state = self.trainable.init(self.config.seed)
        if init_from is not None:
            state = {**state, "params": restore_params(init_from, abstract["params"], identity=self.trainable.identity, same_spec=False)}
        return state, 0, None

    def _say(self, text: str) -> None:
        self.progress.message(text)

    def save(self, step: int) -> None:
        meta = {"step": step, "data": self.data.position(), "seed": self.config.seed,
                "artifact": self.trainable.identity}
        if self.schedule is not None:
            meta["schedule"] = self.schedule.to_json()
        self.checkpoints.save(step, params=self.state["params"], optimizer=_optimizer_item(self.state), meta=meta)

    def _report(self, step: int, metrics: dict, seconds: float, cpu_seconds: float | None = None) -> dict:
        values = {name: scalar(value) for name, value in metrics.items()}
        if not (math.isfinite(values["loss"]) and math.isfinite(values.get("grad_norm", 0.0))):
            kept = self.checkpoints.latest_step()
            where = (f"the last good checkpoint is step {kept} in {self.checkpoints.directory}" if kept is not None
                     else "no checkpoint was saved before it")
            raise NonFiniteLossError(f"step {step}: loss {values['loss']}, gradient norm "
                                     f"{values.get('grad_norm')}; training stopped and {where}")
        layout = self.trainable.layout
        # cpu_seconds: this process's CPU time over the step (all its threads), which a machine
        # shared with other jobs changes less than the wall time.
        record = {"step": step, "kind": "train", **values, "step_seconds": seconds, "cpu_seconds": cpu_seconds,
                  "tokens_per_second": layout.batch * layout.seq / seconds if seconds > 0 else None,
                  "mfu": model_flops_utilisation(self.trainable.flops_per_step, seconds, self.trainable.peak_flops),
                  "epoch": round(self.data.epoch, 6), "time": time.time()}
        self._write(record)
        self.totals.add_train(record)
        self.progress.update(record)
        return record

    def _write(self, record: dict) -> None:
        self.metrics.write(record)
        if self.tensorboard is not None:
            self.tensorboard.write(record)

    def evaluate(self, step: int) -> dict:
        layout = self.trainable.eval_layout
        totals = {"loss": 0.0, "accuracy": 0.0, "tokens": 0.0}
        for batch in eval_batches(self.eval_data, layout, self.config.eval_batches, vocab_size=self.trainable.vocab_size,
                                  doc_mask=self.config.doc_mask):
            values = {k: scalar(v) for k, v in self.trainable.eval_step(self.state["params"], batch).items()}
            for key in ("loss", "accuracy"):
                totals[key] += values[key] * values["tokens"]
            totals["tokens"] += values["tokens"]
        tokens = max(totals["tokens"], 1.0)
        loss = totals["loss"] / tokens
        record = {"step": step, "kind": "eval", "loss": loss, "perplexity": perplexity(loss),
                  "accuracy": totals["accuracy"] / tokens, "tokens": totals["tokens"], "time": time.time()}
        self._write(record)
        self.totals.add_eval(record)
        self._say(f"eval at step {step}: loss {loss:.4f}, perplexity {record['perplexity']:.2f}")
        return record

    def _dispatch(self, step: int, batch) -> tuple[dict, dict]:
        """Runs the update that takes the state from `step` to step + 1."""
        if self.schedule is None:
            return self.trainable.train_step(self.state, batch)
        return self.trainable.train_step(self.state, batch, self.schedule.inputs(step))

    def _announce_schedule(self) -> None:
        schedule = self.schedule
        if schedule is None:
            return
        if self._schedule_changes:
            self._say(f"schedule changed on resume: {'; '.join(self._schedule_changes)}")
        if self.first_step == 0 or self._schedule_changes:
            self._say(f"learning rate: {schedule.describe()}")
        if self.config.steps < schedule.warmup_steps:
            self._say(f"warning: --steps {self.config.steps} ends before the warmup does (step "
                      f"{schedule.warmup_steps}): the learning rate never reaches its peak {schedule.peak:g}; "
                      f"pass --warmup-steps to shorten it")

    def run(self, stop: StopSignal) -> RunSummary:
        config = self.config
        step = self.first_step
        started = time.perf_counter()
        if step >= config.steps:
            self._say(f"the checkpoint in {self.checkpoints.directory} is at step {step}; "
                      f"nothing to do for --steps {config.steps}")
            return RunSummary(step, step, False, None)
        if step:
            self._say(f"resumed from step {step} ({self.checkpoints.directory})")
        self._announce_schedule()
        pending: deque = deque()
        last_time, last_cpu = time.perf_counter(), time.process_time()
        last_record = None
        stopped = False

        def drain(keep: int) -> None:
            nonlocal last_time, last_cpu, last_record
            while len(pending) > keep:
                done_step, metrics = pending.popleft()
                jax.block_until_ready(metrics)
                now, cpu = time.perf_counter(), time.process_time()
                last_record = self._report(done_step, metrics, now - last_time, cpu - last_cpu)
                last_time, last_cpu = now, cpu

        while step < config.steps:
            self.checkpoints.check_saves()  # a background save that failed stops the run here
            batch = self.data.next_batch()
            self.profiler.before_dispatch(step + 1)
            with self.profiler.annotation(step + 1):
                self.state, metrics = self._dispatch(step, batch)
            step += 1
            pending.append((step, metrics))
            drain(config.in_flight - 1)
            if self.profiler.after_dispatch(step, lambda: drain(0)):
                last_time, last_cpu = time.perf_counter(), time.process_time()  # writing the trace is not training time
            stopped = stop.should_stop(step)
            due_save = stopped or step == config.steps or bool(config.save_every and step % config.save_every == 0)
            due_eval = self.eval_data is not None and (
                step == config.steps or bool(config.eval_every and step % config.eval_every == 0))
            if due_save or due_eval:
                drain(0)  # every step up to here seen finite before its state is kept
            if due_eval:
                self.evaluate(step)
                last_time, last_cpu = time.perf_counter(), time.process_time()  # evaluation is not training time
            if due_save:
                self.save(step)
            if stopped:
                self._say(f"signal received: saved step {step} in {self.checkpoints.directory}, stopping")
                break
        self.profiler.stop()  # a window past the last step ends with the run
        self.checkpoints.wait()
        for trace in self.profiler.traces:
            self._say(f"profile of steps {self.profiler.window.first}-{min(self.profiler.window.last, step)}: "
                      f"{trace} (open with: xprof --logdir {self.profiler.window.directory})")
        return RunSummary(self.first_step, step, stopped, None if last_record is None else last_record["loss"],
                          self.totals, time.perf_counter() - started)

    def close(self) -> None:
        self.profiler.stop()
        self.progress.close()
        self.metrics.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        self.checkpoints.close()
