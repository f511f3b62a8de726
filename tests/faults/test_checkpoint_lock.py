"""Two runs on one checkpoint folder: the second is refused, naming the folder (issue 22)."""
import pytest

from mxc.runtime.checkpoint import CheckpointError, Checkpoints


def test_a_second_run_on_a_held_checkpoint_folder_is_refused_naming_it(tmp_path):
    directory = tmp_path / "ckpt"
    first = Checkpoints(directory)
    try:
        with pytest.raises(CheckpointError, match=rf"{directory}: another mxc run is using this checkpoint folder"):
            Checkpoints(directory)
    finally:
        first.close()
    Checkpoints(directory).close()  # free again once the first run closes
