"""Resuming and loading parameters refuse checkpoints that do not belong to the program: another
spec (read from the step's meta before any array), other shapes for --init-from; a run that
fails before its first save leaves no folder behind; commit markers are path-free once the
folder is opened again."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mxc.runtime.checkpoint import COMMIT_MARKER, COMMIT_TEXT, Checkpoints, SpecMismatchError, restore_params
from mxc.runtime.data import BatchLayout, DataError
from mxc.runtime.loop import LoopConfig, StopSignal, TrainingRun
from mxc.runtime.token_file import open_tokens, write_tokens
from mxc.runtime.trainable import Trainable

SEQ, BATCH = 8, 4
LLAMA = {"model": "llama3-tiny", "spec_hash": "3f2a" * 16, "topology": "cpu-1"}
QWEN = {"model": "qwen2.5-tiny", "spec_hash": "9b1c" * 16, "topology": "cpu-1"}


def bigram(identity: dict, vocab: int = 32) -> Trainable:
    """logits[t] = table[inputs[t]], trained with Adam: the smallest model the loop can run."""
    optimizer = optax.adam(0.1)
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))

    @jax.jit
    def train_step(state, batch):
        def loss_fn(params):
            logits = params["table"][batch["inputs"]]
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
            return jnp.mean(losses)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        return ({"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates),
                 "opt_state": opt_state}, {"loss": loss})

    def init(seed):
        params = {"table": jax.random.normal(jax.random.key(seed), (vocab, vocab)) * 0.01}
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": optimizer.init(params)}

    replicated = NamedSharding(mesh, PartitionSpec())
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                            jax.eval_shape(init, 0))
    layout = BatchLayout(BATCH, SEQ, NamedSharding(mesh, PartitionSpec("data")))
    return Trainable(init=init, train_step=train_step, eval_step=None, abstract_state=abstract, layout=layout,
                     eval_layout=layout, vocab_size=vocab, identity=identity)


@pytest.fixture
def tokens(tmp_path):
    stream = np.random.default_rng(0).integers(0, 31, 2000)
    write_tokens(tmp_path / "t.bin", [stream], vocab_size=32, eod_id=31, tokenizer="test")
    return open_tokens(tmp_path / "t.bin")


def train(trainable, tokens, directory, steps, **kwargs):
    run = TrainingRun(trainable, tokens, Checkpoints(directory, keep=None),
                      LoopConfig(steps=steps, save_every=2, progress=False), **kwargs)
    try:
        with StopSignal(multi_process=False) as stop:
            run.run(stop)
    finally:
        run.close()
    return run


def test_resuming_with_another_spec_is_refused_before_any_array_is_read(tmp_path, tokens):
    train(bigram(LLAMA), tokens, tmp_path / "ckpt", 4)
    # Other shapes too: without the meta check, orbax would fail with its tree dump.
    with pytest.raises(SpecMismatchError) as refused:
        TrainingRun(bigram(QWEN, vocab=48), tokens, Checkpoints(tmp_path / "ckpt"), LoopConfig(steps=6, progress=False))
    message = str(refused.value)
    assert message == (f"checkpoint {tmp_path / 'ckpt'} step 4 was trained with llama3-tiny (spec 3f2a3f2a3f2a…), "
                       f"this artifact is qwen2.5-tiny (spec 9b1c9b1c9b1c…): the model specs differ")
    # The same shapes under another spec (a changed rope theta, say) are refused just the same.
    with pytest.raises(SpecMismatchError, match=r"llama3-tiny \(spec 777777777777…\).*specs differ"):
        TrainingRun(bigram({**LLAMA, "spec_hash": "77" * 32}), tokens, Checkpoints(tmp_path / "ckpt"),
                    LoopConfig(steps=6, progress=False))


def test_the_same_spec_under_another_topology_resumes(tmp_path, tokens):
    train(bigram(LLAMA), tokens, tmp_path / "ckpt", 4)
    run = train(bigram({**LLAMA, "topology": "cpu-8"}), tokens, tmp_path / "ckpt", 6)
    assert run.first_step == 4


def test_restore_params_checks_the_spec_or_only_the_shapes(tmp_path, tokens):
    train(bigram(LLAMA), tokens, tmp_path / "ckpt", 2)
    target = bigram(LLAMA).abstract_state["params"]
    assert restore_params(tmp_path / "ckpt", target)["table"].shape == (32, 32)  # no identity: as before
    with pytest.raises(SpecMismatchError, match="trained with llama3-tiny.*this artifact is qwen2.5-tiny"):
        restore_params(tmp_path / "ckpt", target, identity=QWEN)
    # Fine-tuning from another run: the spec may differ, the shapes may not.
    assert restore_params(tmp_path / "ckpt", target, identity=QWEN, same_spec=False)["table"].shape == (32, 32)
    with pytest.raises(SpecMismatchError) as refused:
        restore_params(tmp_path / "ckpt", bigram(QWEN, vocab=48).abstract_state["params"], identity=QWEN,
                       same_spec=False)
    assert str(refused.value) == (
        f"checkpoint {tmp_path / 'ckpt'} step 2 was trained with llama3-tiny (spec 3f2a3f2a3f2a…), this artifact is "
        "qwen2.5-tiny (spec 9b1c9b1c9b1c…); parameter ['table'] is of shape [32, 32] there and of shape [48, 48] here")


def test_init_from_a_checkpoint_of_other_shapes_is_one_line(tmp_path, tokens):
    train(bigram(LLAMA), tokens, tmp_path / "first", 2)
    with pytest.raises(SpecMismatchError, match=r"parameter \['table'\] is of shape \[32, 32\] there"):
        TrainingRun(bigram(QWEN, vocab=48), tokens, Checkpoints(tmp_path / "second"),
                    LoopConfig(steps=2, progress=False), init_from=tmp_path / "first")
    assert not (tmp_path / "second").exists()


def test_a_run_failing_before_its_first_save_leaves_no_folder_it_created(tmp_path, tokens):
    short = tmp_path / "short.bin"
    write_tokens(short, [np.arange(4)], vocab_size=32, eod_id=31, tokenizer="test")
    with pytest.raises(DataError):
        TrainingRun(bigram(LLAMA), open_tokens(short), Checkpoints(tmp_path / "runs" / "new"),
                    LoopConfig(steps=2, progress=False))
    assert not (tmp_path / "runs").exists()
    # A folder the user had (even empty) stays, without our lock file.
    (tmp_path / "mine").mkdir()
    with pytest.raises(DataError):
        TrainingRun(bigram(LLAMA), open_tokens(short), Checkpoints(tmp_path / "mine"),
                    LoopConfig(steps=2, progress=False))
    assert (tmp_path / "mine").is_dir()
    # A spec mismatch on resume never removes the folder holding the checkpoint.
    train(bigram(LLAMA), tokens, tmp_path / "ckpt", 2)
    with pytest.raises(SpecMismatchError):
        TrainingRun(bigram(QWEN), tokens, Checkpoints(tmp_path / "ckpt"), LoopConfig(steps=4, progress=False))
    assert (tmp_path / "ckpt" / "2").is_dir()


def test_a_marker_left_with_a_path_by_a_killed_run_is_scrubbed_when_the_folder_is_opened(tmp_path, tokens):
    train(bigram(LLAMA), tokens, tmp_path / "ckpt", 2)
    markers = list((tmp_path / "ckpt").glob("*/**/" + COMMIT_MARKER))
    assert markers
    for marker in markers:  # as a run killed with -9 right after its save leaves them
        marker.write_text(f"{COMMIT_TEXT} at {marker.parent}")
    Checkpoints(tmp_path / "ckpt").close()
    assert all(marker.read_text() == COMMIT_TEXT for marker in markers)
