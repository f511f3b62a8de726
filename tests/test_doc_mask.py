"""Document masking of packed sequences: a row that packs several documents, with segment ids and
positions restarting per document, gives each document the logits and loss it has when it runs
alone (the independent reference: the same model on each document as its own row); the data
pipeline derives those ids and positions from end-of-document tokens; without document masking
(`--no-doc-mask`) rows are one segment at positions 0..seq-1, as before; splash attention honours
the segment ids like the XLA path (the kernel run by Pallas's interpreter on the CPU)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mxc.compiler.lower.attention_core import attend
from mxc.compiler.lower.model import forward
from mxc.compiler.lower.params import init_params
from mxc.runtime.data import BATCH_KEYS, BatchLayout, PackedSequences, TrainData, document_layout
from mxc.runtime.token_file import open_tokens, write_tokens
from mxc.spec.load import load_models

EOD = 7  # the end-of-document id of these tests' token streams
DOCUMENT_LENGTHS = (6, 11, 3, 9)  # tokens of each document before its end-of-document token

# Attention kinds that go through the one attention core, on tiny models: overrides of a zoo model.
MODELS = {
    "llama_gqa": ("llama3-tiny", []),
    "sliding_window_sinks": ("llama3-tiny", ["block.attention.window=4", "block.attention.sinks=true"]),
    "chunked": ("llama3-tiny", ["block.attention.chunk=4"]),
    "mla_moe_mtp": ("mla-tiny", []),
}
SLOW_MODELS = ("sliding_window_sinks", "mla_moe_mtp")  # each compiles its own model


def _spec(case):
    name, overrides = MODELS[case]
    (spec,) = load_models(name, overrides).values()
    return spec.model_copy(update={"compute_dtype": "float32"})


def _documents(vocab, seed=0):
    rng = np.random.default_rng(seed)
    # Ids above EOD only, so no document holds an end-of-document token of its own.
    return [np.append(rng.integers(EOD + 1, vocab, size=n), EOD) for n in DOCUMENT_LENGTHS]


def _packed_row(documents, *, doc_mask=True):
    """One row holding every document, built by the data pipeline from a token stream."""
    stream = np.concatenate(documents)
    rows = PackedSequences(_TokenStream(stream), seq=len(stream) - 1, doc_mask=doc_mask).rows(np.arange(1))
    return {name: jnp.asarray(value) for name, value in rows.items()}


class _TokenStream:
    """The parts of a TokenFile PackedSequences reads, for a stream held in memory."""

    def __init__(self, tokens, eod_id=EOD):
        self.tokens, self.eod_id, self.vocab_size, self.path = np.asarray(tokens), eod_id, None, "<stream>"

    def __len__(self):
        return len(self.tokens)


def _alone(documents):
    """Each document as its own row, padded at the end to the longest (causal attention keeps the
    padding out of every real position); the padding is out of the loss."""
    length = max(len(d) for d in documents) - 1
    inputs, targets, mask = (np.zeros((len(documents), length), dtype) for dtype in (np.int32, np.int32, np.float32))
    for row, document in enumerate(documents):
        n = len(document) - 1
        inputs[row, :n], targets[row, :n], mask[row, :n] = document[:-1], document[1:], 1.0
    return {"inputs": jnp.asarray(inputs), "targets": jnp.asarray(targets), "mask": jnp.asarray(mask)}


def _logits_and_sums(spec):
    """One jitted function for both the packed row and the documents alone: (logits, loss sums)."""
    from mxc.compiler.lower.train import model_loss_sums

    sums_fn = model_loss_sums(spec)

    def run(params, batch):
        logits, _ = forward(spec, params, batch["inputs"], positions=batch.get("positions"),
                            segment_ids=batch.get("segment_ids"))
        return logits, sums_fn(params, batch)

    return jax.jit(run)


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.slow) if case in SLOW_MODELS else case
                                  for case in MODELS])
def test_packed_documents_match_each_document_alone(case):
    spec = _spec(case)
    params = init_params(spec, jax.random.key(0))
    documents = _documents(spec.vocab)
    run = _logits_and_sums(spec)
    packed, packed_sums = run(params, _packed_row(documents))
    alone, alone_sums = run(params, _alone(documents))
    start = 0
    for row, document in enumerate(documents):
        length = len(document) - 1  # its inputs: every token but its end-of-document token
        np.testing.assert_allclose(packed[0, start:start + length], alone[row, :length], atol=2e-5, rtol=1e-5)
        start += len(document)
    assert float(jnp.abs(packed).max()) > 0.01

    # The loss: the packed row's sums are the documents' (with multi-token prediction where the
    # model has it); MoE's load-balancing term is over the batch, so it is left out here.
    for field in ("cross_entropy", "tokens", "correct", "mtp"):
        np.testing.assert_allclose(float(getattr(packed_sums, field)), float(getattr(alone_sums, field)),
                                   rtol=2e-5, err_msg=field)
    if spec.mtp is not None:
        assert float(packed_sums.mtp) > 0


def test_without_document_masking_a_row_is_one_sequence_as_before():
    spec = _spec("llama_gqa")
    params = init_params(spec, jax.random.key(0))
    documents = _documents(spec.vocab)
    row = _packed_row(documents, doc_mask=False)
    np.testing.assert_array_equal(row["segment_ids"], 1)
    np.testing.assert_array_equal(row["positions"][0], np.arange(row["inputs"].shape[1]))
    plain, _ = forward(spec, params, row["inputs"])  # no segment ids, positions counted: the old program
    unmasked, _ = forward(spec, params, row["inputs"], positions=row["positions"], segment_ids=row["segment_ids"])
    np.testing.assert_array_equal(unmasked, plain)
    masked = _packed_row(documents)
    # The mask is the same either way: the target after an end-of-document input is left out.
    np.testing.assert_array_equal(row["mask"], masked["mask"])
    # And attention across documents does change the later documents' logits.
    crossed, _ = forward(spec, params, masked["inputs"], positions=masked["positions"],
                         segment_ids=masked["segment_ids"])
    second = slice(len(documents[0]), len(documents[0]) + len(documents[1]) - 1)
    assert float(jnp.abs(crossed[0, second] - plain[0, second]).max()) > 1e-3


# ------------------------------------------------------------------ the data pipeline

def _reference_layout(inputs, eod_id):
    """Segment ids and positions by a loop over the row: a document starts after each eod input."""
    segment, position, segments, positions = 1, 0, [], []
    for t, token in enumerate(inputs):
        if t and inputs[t - 1] == eod_id:
            segment, position = segment + 1, 0
        segments.append(segment)
        positions.append(position)
        position += 1
    return segments, positions


def test_data_pipeline_gives_segment_ids_and_positions_from_end_of_document_tokens(tmp_path):
    rng = np.random.default_rng(1)
    documents = [np.append(rng.integers(0, 50, size=rng.integers(1, 12)), 99) for _ in range(40)]
    stream = np.concatenate(documents)
    write_tokens(tmp_path / "t.bin", [stream], vocab_size=100, eod_id=99, tokenizer="test")
    sequences = PackedSequences(open_tokens(tmp_path / "t.bin"), seq=16)
    rows = sequences.rows(np.arange(sequences.count))
    assert set(rows) == set(BATCH_KEYS)
    for i in range(sequences.count):
        segments, positions = _reference_layout(list(rows["inputs"][i]), 99)
        assert list(rows["segment_ids"][i]) == segments and list(rows["positions"][i]) == positions
    assert rows["segment_ids"].max() > 2  # rows do pack several documents
    # A hand-made row: documents [5 6 99] [7 99] [8 ...
    segments, positions = document_layout(np.array([[5, 6, 99, 7, 99, 8, 9]]), 99)
    np.testing.assert_array_equal(segments, [[1, 1, 1, 2, 2, 3, 3]])
    np.testing.assert_array_equal(positions, [[0, 1, 2, 0, 1, 0, 1]])

    # The global batch the train step gets carries them, int32; --no-doc-mask, or a file
    # without an end-of-document id, gives one segment counted from 0.
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    layout = BatchLayout(4, 16, NamedSharding(mesh, PartitionSpec("data")))
    for doc_mask, tokens in ((True, open_tokens(tmp_path / "t.bin")), (False, open_tokens(tmp_path / "t.bin")),
                             (True, _without_eod(tmp_path, stream))):
        batch = TrainData(tokens, layout, seed=0, doc_mask=doc_mask).next_batch()
        assert set(batch) == set(BATCH_KEYS)
        assert batch["segment_ids"].dtype == jnp.int32 and batch["positions"].dtype == jnp.int32
        segments, positions = np.asarray(batch["segment_ids"]), np.asarray(batch["positions"])
        if doc_mask and tokens.eod_id is not None:
            assert segments.max() > 1
            for row in range(4):
                expected = _reference_layout(list(np.asarray(batch["inputs"])[row]), 99)
                assert (list(segments[row]), list(positions[row])) == expected
        else:
            np.testing.assert_array_equal(segments, 1)
            np.testing.assert_array_equal(positions, np.broadcast_to(np.arange(16), (4, 16)))


def _without_eod(tmp_path, stream):
    write_tokens(tmp_path / "plain.bin", [stream], vocab_size=100, eod_id=None, tokenizer="test")
    return open_tokens(tmp_path / "plain.bin")


# ------------------------------------------------------------------ splash attention

SPLASH_SEQ = 256  # two 128-token tiles
SPLASH_DOCUMENTS = (70, 100, 1, 85)  # boundaries inside tiles and across the tile edge


def _splash_inputs(heads, kv_heads, head_dim=16, batch=2):
    keys = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(keys[0], (batch, SPLASH_SEQ, heads, head_dim))
    k = jax.random.normal(keys[1], (batch, SPLASH_SEQ, kv_heads, head_dim))
    v = jax.random.normal(keys[2], (batch, SPLASH_SEQ, kv_heads, head_dim))
    segments = np.concatenate([np.full(n, i + 1) for i, n in enumerate(SPLASH_DOCUMENTS)])
    positions = np.concatenate([np.arange(n) for n in SPLASH_DOCUMENTS])
    # The second row is one document: the kernel's ids are per row.
    segment_ids = jnp.asarray(np.stack([segments, np.ones(SPLASH_SEQ)]), jnp.int32)
    positions = jnp.asarray(np.stack([positions, np.arange(SPLASH_SEQ)]), jnp.int32)
    return q, k, v, segment_ids, positions


SPLASH_CASES = {
    "causal_gqa": dict(heads=4, kv_heads=2, options={}),
    "window_sinks": dict(heads=4, kv_heads=2, options={"window": 40, "sinks": True}),
    "chunked": dict(heads=2, kv_heads=1, options={"chunk": 32}),
}


@pytest.mark.parametrize("case", [case if case == "chunked" else pytest.param(case, marks=pytest.mark.slow)
                                  for case in SPLASH_CASES])
def test_splash_honours_segment_ids_like_the_xla_path(case):
    from mxc.compiler.lower.splash import splash_attend

    heads, kv_heads, options = (SPLASH_CASES[case][key] for key in ("heads", "kv_heads", "options"))
    options = dict(options, scale=0.3)
    if options.pop("sinks", False):
        options["sinks"] = jnp.linspace(-1.0, 2.0, heads)
    q, k, v, segment_ids, positions = _splash_inputs(heads, kv_heads)
    where = dict(q_positions=positions, kv_positions=positions, segment_ids=segment_ids)
    reference = attend(q, k, v, **where, **options)
    kernel = splash_attend(q, k, v, **where, interpret=True, **options)
    np.testing.assert_allclose(kernel, reference, atol=2e-5, rtol=1e-5)
    # Each document alone (the first row's), through the XLA path, is what the packed row gave.
    start = 0
    for n in SPLASH_DOCUMENTS:
        part = slice(start, start + n)
        alone_positions = jnp.arange(n, dtype=jnp.int32)[None]
        alone = attend(q[:1, part], k[:1, part], v[:1, part], q_positions=alone_positions,
                       kv_positions=alone_positions, **options)
        np.testing.assert_allclose(kernel[:1, part], alone, atol=2e-5, rtol=1e-5)
        start += n


# ------------------------------------------------------------------ mxc run, end to end

@pytest.mark.slow
def test_mxc_run_masks_documents_unless_told_not_to(tmp_path):
    """The first step's loss of `mxc run` on a compiled artifact is the runtime's eval of the
    same parameters on the batch with segment ids and positions per document; with --no-doc-mask,
    on the batch of one segment per row; and the two differ."""
    import subprocess

    from artifact_builds import child_report
    from runtime_support import MXC, compile_tiny, corpus_files, cpu_env, read_metrics, run_command

    artifact = compile_tiny(tmp_path / "artifact")
    tokens = tmp_path / "tokens.bin"
    done = subprocess.run([MXC, "tokenize", *corpus_files(), "--split", "paragraph", "-o", str(tokens)],
                          env=cpu_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    losses = {}
    for name, extra in (("doc_mask", []), ("no_doc_mask", ["--no-doc-mask"])):
        metrics = tmp_path / f"{name}.jsonl"
        done = subprocess.run(run_command(artifact, tokens, tmp_path / f"{name}_ckpt", steps=1, metrics=metrics,
                                          extra=["--quiet", *extra]),
                              env=cpu_env(), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
        (record,) = read_metrics(metrics)
        losses[name] = record["loss"]
    reference = child_report("doc_mask_first_batch", str(artifact), str(tokens), "0", env=cpu_env(8))
    assert reference["segments"] > 1  # the first batch does pack several documents into a row
    for name in ("doc_mask", "no_doc_mask"):
        np.testing.assert_allclose(losses[name], reference[name], rtol=1e-5, err_msg=name)
    assert abs(losses["doc_mask"] - losses["no_doc_mask"]) > 1e-4


@pytest.mark.slow
def test_sharded_splash_honours_segment_ids():
    """The kernel inside shard_map (batch and heads split over 4 devices) takes each shard's rows'
    segment ids: the same result as the unsharded XLA path."""
    from artifact_builds import child_report

    report = child_report("splash_sharded_segments", JAX_PLATFORMS="cpu",
                          XLA_FLAGS="--xla_force_host_platform_device_count=4")
    assert report["devices"] == 4
    assert report["window_sinks"] < 2e-5 and report["chunked"] < 2e-5
