"""A checkpoint is used only by a program of the spec it was trained with: resuming and loading
parameters read the step's meta before any array and refuse another spec in one line naming
both models; --init-from (fine-tuning another run's parameters) refuses only other shapes."""

import pytest
from bigram_run import LLAMA, QWEN, bigram, token_file, train

from mxc.runtime.checkpoint import CheckpointError, Checkpoints, SpecMismatchError, restore_params
from mxc.runtime.cli import is_user_error
from mxc.runtime.loop import LoopConfig, TrainingRun


@pytest.fixture
def tokens(tmp_path):
    return token_file(tmp_path / "t.bin")


def _resume(trainable, tokens, directory, **kwargs):
    run = TrainingRun(trainable, tokens, Checkpoints(directory), LoopConfig(steps=6, progress=False), **kwargs)
    run.close()
    return run


def test_resuming_with_another_model_is_refused_naming_both(tmp_path, tokens):
    train(bigram(LLAMA), tokens, tmp_path / "ckpt", 4)
    # Other shapes: without reading the meta first, orbax would fail with its tree dump.
    with pytest.raises(SpecMismatchError) as refused:
        _resume(bigram(QWEN, vocab=48), tokens, tmp_path / "ckpt")
    assert str(refused.value) == (
        f"checkpoint {tmp_path / 'ckpt'} step 4 was trained with llama3-tiny (spec 3f2a3f2a3f2a…), "
        "this artifact is qwen2.5-tiny (spec 9b1c9b1c9b1c…): the model specs differ")
    assert is_user_error(refused.value)  # the CLI prints it as `mxc: error: ...`, no traceback


def test_resuming_with_the_same_shapes_under_another_spec_is_refused(tmp_path, tokens):
    train(bigram(LLAMA), tokens, tmp_path / "ckpt", 2)
    changed = {**LLAMA, "spec_hash": "77" * 32}  # rope theta changed, say: same shapes
    with pytest.raises(SpecMismatchError, match=r"trained with llama3-tiny \(spec 3f2a.*this artifact is "
                                                r"llama3-tiny \(spec 777777777777…\): the model specs differ"):
        _resume(bigram(changed), tokens, tmp_path / "ckpt", )
    # --fallback is for corrupt steps: an older step of another spec is no way out.
    with pytest.raises(SpecMismatchError):
        TrainingRun(bigram(changed), tokens, Checkpoints(tmp_path / "ckpt"),
                    LoopConfig(steps=6, progress=False, fallback=True)).close()


def test_the_same_spec_under_another_topology_resumes(tmp_path, tokens):
    train(bigram(LLAMA), tokens, tmp_path / "ckpt", 4)
    run = train(bigram({**LLAMA, "topology": "cpu-8"}), tokens, tmp_path / "ckpt", 6)
    assert run.first_step == 4


def test_checkpoints_without_a_spec_hash_still_resume(tmp_path, tokens):
    train(bigram({"model": "bigram"}), tokens, tmp_path / "ckpt", 2)
    assert _resume(bigram(LLAMA), tokens, tmp_path / "ckpt").first_step == 2


def test_restore_params_refuses_another_spec_when_given_the_identity(tmp_path, tokens):
    train(bigram(LLAMA), tokens, tmp_path / "ckpt", 2)
    target = bigram(LLAMA).abstract_state["params"]
    assert restore_params(tmp_path / "ckpt", target)["table"].shape == (32, 32)  # no identity: unchecked
    assert restore_params(tmp_path / "ckpt", target, identity=LLAMA)["table"].shape == (32, 32)
    with pytest.raises(SpecMismatchError, match=r"^checkpoint .*ckpt step 2 was trained with llama3-tiny .*"
                                                r"this artifact is qwen2\.5-tiny .*: the model specs differ$"):
        restore_params(tmp_path / "ckpt", target, identity=QWEN)


def test_restore_params_for_fine_tuning_refuses_only_other_shapes(tmp_path, tokens):
    train(bigram(LLAMA), tokens, tmp_path / "ckpt", 2)
    same_shapes = bigram(QWEN).abstract_state["params"]
    assert restore_params(tmp_path / "ckpt", same_shapes, identity=QWEN, same_spec=False)["table"].shape == (32, 32)
    with pytest.raises(SpecMismatchError) as refused:
        restore_params(tmp_path / "ckpt", bigram(QWEN, vocab=48).abstract_state["params"], identity=QWEN,
                       same_spec=False)
    assert str(refused.value) == (
        f"checkpoint {tmp_path / 'ckpt'} step 2 was trained with llama3-tiny (spec 3f2a3f2a3f2a…), this artifact "
        "is qwen2.5-tiny (spec 9b1c9b1c9b1c…); parameter ['table'] is of shape [32, 32] there and of shape "
        "[48, 48] here")


def test_init_from_a_run_of_other_shapes_is_one_line_and_leaves_no_folder(tmp_path, tokens):
    train(bigram(LLAMA), tokens, tmp_path / "first", 2)
    with pytest.raises(CheckpointError, match=r"parameter \['table'\] is of shape \[32, 32\] there and of "
                                              r"shape \[48, 48\] here$"):
        TrainingRun(bigram(QWEN, vocab=48), tokens, Checkpoints(tmp_path / "second"),
                    LoopConfig(steps=2, progress=False), init_from=tmp_path / "first")
    assert not (tmp_path / "second").exists()
    # Another spec of the same shapes is a fine-tuning start, as before.
    run = train(bigram(QWEN), tokens, tmp_path / "third", 2, init_from=tmp_path / "first")
    assert run.first_step == 0


def test_init_from_a_run_that_recorded_no_model_still_names_the_parameter(tmp_path, tokens):
    train(bigram({}), tokens, tmp_path / "first", 2)
    with pytest.raises(SpecMismatchError, match=r"^checkpoint .*first step 2 does not fit this model: parameter "
                                                r"\['table'\] is of shape \[32, 32\] there and of shape \[48, 48\] here$"):
        restore_params(tmp_path / "first", bigram(QWEN, vocab=48).abstract_state["params"], identity=QWEN,
                       same_spec=False)
