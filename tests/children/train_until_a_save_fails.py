"""Trains the bigram model until a checkpoint save fails in the background, as on a full disk.

    python train_until_a_save_fails.py DIRECTORY TOKENS SAVE_EVERY

Needs tests/faults on PYTHONPATH (bigram_run). Step 2 is saved while writes still work; then the
process ignores SIGXFSZ and lowers RLIMIT_FSIZE to 256 bytes, so every later save fails with
EFBIG. Prints "stopped at step N: ERROR" and exits 3 when the run stops on the SaveError."""

import resource
import signal
import sys

from bigram_run import LLAMA, bigram, token_file, train

from mxc.runtime.checkpoint import Checkpoints, SaveError
from mxc.runtime.loop import LoopConfig, StopSignal, TrainingRun


def main(directory: str, tokens_path: str, save_every: str) -> int:
    tokens = token_file(tokens_path)
    train(bigram(LLAMA), tokens, directory, 2)  # step 2 saved while writes still work
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256, resource.RLIM_INFINITY))
    run = TrainingRun(bigram(LLAMA), tokens, Checkpoints(directory, keep=None),
                      LoopConfig(steps=40, save_every=int(save_every), progress=False))
    try:
        with StopSignal(multi_process=False) as stop:
            run.run(stop)
    except SaveError as err:
        print(f"stopped at step {int(run.state['step'])}: {err}", flush=True)
        return 3
    finally:
        run.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
