"""Token files, tokenizers, packing, masks, data order and the resumable position.

References are written out independently: a Python loop over the token stream for the windows
and masks, and explicit sets for the coverage of an epoch.
"""

import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mxc.runtime.data import BatchLayout, DataError, PackedSequences, ShuffledOrder, TrainData, eval_batches
from mxc.runtime.token_file import MAGIC, TokenFileError, open_tokens, write_tokens
from mxc.runtime.tokenize import (BYTE_EOD_ID, TokenizerError, byte_tokenizer, load_tokenizer, tokenize_files)


def _layout(batch=4, seq=8, mask_dtype=np.float32):
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    return BatchLayout(batch, seq, NamedSharding(mesh, PartitionSpec("data")), np.dtype(mask_dtype))


def _write(path, tokens, eod_id=None, vocab_size=1000):
    write_tokens(path, [np.asarray(tokens)], vocab_size=vocab_size, eod_id=eod_id, tokenizer="test")
    return open_tokens(path)


# ------------------------------------------------------------------ token files

def test_bin_file_round_trip_and_header(tmp_path):
    tokens = np.arange(1000) % 700
    opened = _write(tmp_path / "t.bin", tokens, eod_id=699, vocab_size=700)
    np.testing.assert_array_equal(opened.tokens, tokens)
    assert opened.tokens.dtype == np.uint16 and isinstance(opened.tokens, np.memmap)
    assert (opened.eod_id, opened.vocab_size, opened.tokenizer) == (699, 700, "test")
    raw = (tmp_path / "t.bin").read_bytes()
    assert raw[:8] == MAGIC
    length = int.from_bytes(raw[8:12], "little")
    header = json.loads(raw[12:12 + length])
    assert header["tokens"] == 1000 and header["dtype"] == "uint16"
    assert (12 + length) % 64 == 0  # the tokens start aligned


def test_large_vocabularies_are_stored_as_uint32(tmp_path):
    opened = _write(tmp_path / "t.bin", [5, 100_000, 7], vocab_size=128_256)
    assert opened.tokens.dtype == np.uint32
    assert list(opened.tokens) == [5, 100_000, 7]


def test_truncated_and_foreign_files_are_refused(tmp_path):
    _write(tmp_path / "t.bin", np.arange(100))
    data = (tmp_path / "t.bin").read_bytes()
    (tmp_path / "cut.bin").write_bytes(data[:-10])
    with pytest.raises(TokenFileError, match="truncated"):
        open_tokens(tmp_path / "cut.bin")
    (tmp_path / "other.bin").write_bytes(b"\x00" * 64)
    with pytest.raises(TokenFileError, match="not an mxc token file"):
        open_tokens(tmp_path / "other.bin")


def test_ids_outside_the_vocabulary_are_refused_when_writing(tmp_path):
    with pytest.raises(TokenFileError, match=r"\[0, 10\)"):
        write_tokens(tmp_path / "t.bin", [np.array([1, 10])], vocab_size=10, eod_id=None, tokenizer="x")
    assert not list(tmp_path.iterdir())  # nothing half-written is left behind


def test_npy_files_are_memory_mapped_with_an_eod_id_given(tmp_path):
    np.save(tmp_path / "t.npy", np.arange(50, dtype=np.int32))
    opened = open_tokens(tmp_path / "t.npy", eod_id=3)
    assert opened.eod_id == 3 and len(opened) == 50
    np.save(tmp_path / "two.npy", np.zeros((2, 2), np.int32))
    with pytest.raises(TokenFileError, match="1-D integer"):
        open_tokens(tmp_path / "two.npy")


# ------------------------------------------------------------------ tokenizers

def test_byte_tokenizer_ends_every_document(tmp_path):
    (tmp_path / "a.txt").write_text("héllo\n\nworld", encoding="utf-8")
    (tmp_path / "b.jsonl").write_text('{"text": "ab"}\n\n{"text": "c"}\n', encoding="utf-8")
    result = tokenize_files([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")], str(tmp_path / "t.bin"),
                            tokenizer=byte_tokenizer())
    expected = [*"héllo\n\nworld".encode(), BYTE_EOD_ID, *b"ab", BYTE_EOD_ID, *b"c", BYTE_EOD_ID]
    opened = open_tokens(tmp_path / "t.bin")
    assert list(opened.tokens) == expected
    assert result["documents"] == 3 and opened.eod_id == BYTE_EOD_ID and opened.vocab_size == 257


def test_paragraph_split_makes_one_document_per_paragraph(tmp_path):
    (tmp_path / "a.txt").write_text("one\n\ntwo\n  \nthree", encoding="utf-8")
    result = tokenize_files([str(tmp_path / "a.txt")], str(tmp_path / "t.bin"), tokenizer=byte_tokenizer(),
                            split="paragraph")
    assert result["documents"] == 3
    assert list(open_tokens(tmp_path / "t.bin").tokens).count(BYTE_EOD_ID) == 3


def test_hf_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("hello world hello", encoding="utf-8")
    loaded = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert (loaded.eod_id, loaded.vocab_size) == (1, 4)
    tokenize_files([str(tmp_path / "a.txt")], str(tmp_path / "t.bin"), tokenizer=loaded)
    assert list(open_tokens(tmp_path / "t.bin").tokens) == [2, 3, 2, 1]
    with pytest.raises(TokenizerError, match="--eod-token"):
        load_tokenizer(str(tmp_path / "tokenizer.json"), eod_token="<|none|>")


def test_sentencepiece_model_without_the_package_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "sentencepiece", None)  # import fails as if absent
    (tmp_path / "tokenizer.model").write_bytes(b"not a model")
    with pytest.raises(TokenizerError, match="pip install sentencepiece"):
        load_tokenizer(str(tmp_path / "tokenizer.model"))


# ------------------------------------------------------------------ packing and masks

def _reference_rows(stream, seq, index, eod_id):
    """Window `index` by hand: seq + 1 tokens from index·seq; a target after an EOD is masked."""
    window = list(stream[index * seq: index * seq + seq + 1])
    inputs, targets = window[:-1], window[1:]
    mask = [token != eod_id for token in inputs]
    return inputs, targets, mask


def test_windows_and_document_masks_match_a_reference(tmp_path):
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 50, size=rng.integers(1, 12)) for _ in range(30)]
    stream = np.concatenate([np.append(d, 99) for d in documents])
    opened = _write(tmp_path / "t.bin", stream, eod_id=99, vocab_size=100)
    packed = PackedSequences(opened, seq=8)
    assert packed.count == (len(stream) - 1) // 8
    indices = np.arange(packed.count)
    rows = packed.rows(indices)
    for i in indices:
        inputs, targets, mask = _reference_rows(stream, 8, i, 99)
        assert list(rows["inputs"][i]) == inputs and list(rows["targets"][i]) == targets
        assert list(rows["mask"][i]) == mask
    # Each target is the next token; the only masked targets start a new document.
    assert not rows["mask"][rows["inputs"] == 99].any()
    assert rows["mask"][rows["inputs"] != 99].all()


def test_every_token_is_a_target_once_per_epoch(tmp_path):
    stream = np.arange(8 * 25 + 1) % 97
    packed = PackedSequences(_write(tmp_path / "t.bin", stream), seq=8)
    targets = packed.rows(np.arange(packed.count))["targets"].ravel()
    np.testing.assert_array_equal(targets, stream[1:])


def test_a_file_shorter_than_one_sequence_is_refused(tmp_path):
    with pytest.raises(DataError, match="do not fill one sequence"):
        PackedSequences(_write(tmp_path / "t.bin", np.arange(8)), seq=8)


def test_ids_beyond_the_model_vocabulary_are_refused(tmp_path):
    with pytest.raises(DataError, match=r"vocabulary \(1000 ids\) is larger than the model's \(50\)"):
        PackedSequences(_write(tmp_path / "t.bin", np.arange(100), vocab_size=1000), seq=8, vocab_size=50)
    np.save(tmp_path / "t.npy", np.arange(100))  # no header: caught when the file is first read
    with pytest.raises(DataError, match="token id 99 is outside the model's vocabulary of 50"):
        PackedSequences(open_tokens(tmp_path / "t.npy"), seq=8, vocab_size=50)


# ------------------------------------------------------------------ order and position

def test_each_epoch_is_a_permutation_and_the_seed_decides_it():
    order = ShuffledOrder(count=20, seed=1)
    first, second = order(np.arange(20)), order(np.arange(20, 40))
    assert sorted(first) == list(range(20)) and sorted(second) == list(range(20))
    assert list(first) != list(second)  # a new permutation each epoch
    np.testing.assert_array_equal(ShuffledOrder(20, 1)(np.arange(40)), np.concatenate([first, second]))
    assert list(ShuffledOrder(20, 2)(np.arange(20))) != list(first)


def _host(batch):
    return {k: np.asarray(v) for k, v in batch.items()}


def test_batches_follow_the_order_and_the_position_restores_exactly(tmp_path):
    stream = np.arange(8 * 40 + 1) % 50
    opened = _write(tmp_path / "t.bin", np.append(stream, 0), eod_id=49, vocab_size=60)
    layout = _layout(batch=4, seq=8)
    data = TrainData(opened, layout, seed=7)
    first = [_host(data.next_batch()) for _ in range(3)]
    assert first[0]["mask"].dtype == np.float32 and first[0]["inputs"].dtype == np.int32
    expected = data.sequences.rows(ShuffledOrder(data.sequences.count, 7)(np.arange(4)))
    np.testing.assert_array_equal(first[0]["inputs"], expected["inputs"])
    position = json.loads(json.dumps(data.position()))  # it goes through a JSON checkpoint item
    later = [_host(data.next_batch()) for _ in range(15)]  # crosses into the next epoch

    resumed = TrainData(opened, layout, seed=123)  # the checkpoint's seed wins
    resumed.restore(position)
    for batch, again in zip(later, (_host(resumed.next_batch()) for _ in range(15))):
        for key in batch:
            np.testing.assert_array_equal(batch[key], again[key])


def test_a_position_from_other_data_is_refused(tmp_path):
    layout = _layout()
    data = TrainData(_write(tmp_path / "a.bin", np.arange(200) % 50), layout, seed=0)
    other = TrainData(_write(tmp_path / "b.bin", np.arange(300) % 50), layout, seed=0)
    with pytest.raises(DataError, match="other data"):
        other.restore(data.position())


def test_eval_batches_are_the_same_every_time(tmp_path):
    opened = _write(tmp_path / "t.bin", np.arange(8 * 20 + 1) % 50)
    layout = _layout(batch=4, seq=8)
    first = [_host(b) for b in eval_batches(opened, layout, 3)]
    second = [_host(b) for b in eval_batches(opened, layout, 3)]
    assert len(first) == 3
    np.testing.assert_array_equal(first[0]["inputs"][0], np.arange(8))  # file order
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a["targets"], b["targets"])


# ------------------------------------------------------------------ content fingerprint

def _reference_fingerprint(ids) -> str:
    """Written out here from the definition: sha256 of the ids as little-endian int64."""
    import hashlib
    return hashlib.sha256(b"".join(int(i).to_bytes(8, "little", signed=True) for i in ids)).hexdigest()


def _header(path):
    raw = path.read_bytes()
    return json.loads(raw[12:12 + int.from_bytes(raw[8:12], "little")])


def test_tokenize_records_the_fingerprint_of_the_ids_in_the_header(tmp_path):
    (tmp_path / "a.txt").write_text("héllo")
    tokenize_files([str(tmp_path / "a.txt")], str(tmp_path / "t.bin"), tokenizer=byte_tokenizer())
    expected = _reference_fingerprint([*"héllo".encode("utf-8"), BYTE_EOD_ID])
    assert _header(tmp_path / "t.bin")["fingerprint"] == expected
    assert open_tokens(tmp_path / "t.bin").fingerprint == expected


def test_the_same_ids_have_one_fingerprint_whatever_file_holds_them(tmp_path, monkeypatch):
    import mxc.runtime.token_file as token_file
    ids = (np.arange(1000) * 7919) % 700
    monkeypatch.setattr(token_file, "FINGERPRINT_BLOCK_TOKENS", 64)  # many blocks, a short last one
    np.save(tmp_path / "a.npy", ids.astype(np.int32))
    np.save(tmp_path / "b.npy", ids.astype(">u8"))  # big-endian in the file
    fingerprints = {open_tokens(tmp_path / "a.npy").fingerprint, open_tokens(tmp_path / "b.npy").fingerprint,
                    _write(tmp_path / "c.bin", ids, vocab_size=700).fingerprint}
    assert fingerprints == {_reference_fingerprint(ids)}


def test_a_token_file_written_before_fingerprints_still_opens_and_gets_one(tmp_path):
    ids = np.arange(300) % 50
    _write(tmp_path / "new.bin", ids)
    header = {key: value for key, value in _header(tmp_path / "new.bin").items() if key != "fingerprint"}
    text = json.dumps(header).encode()
    (tmp_path / "old.bin").write_bytes(MAGIC + len(text).to_bytes(4, "little") + text
                                       + ids.astype("<u2").tobytes())
    assert open_tokens(tmp_path / "old.bin").fingerprint == _reference_fingerprint(ids)


def test_a_position_from_other_data_of_the_same_length_is_refused_naming_the_file(tmp_path):
    layout = _layout()
    data = TrainData(_write(tmp_path / "a.bin", np.arange(200) % 50), layout, seed=0)
    other = TrainData(_write(tmp_path / "b.bin", (np.arange(200) + 1) % 50), layout, seed=0)
    position = json.loads(json.dumps(data.position()))
    assert position["fingerprint"] == _reference_fingerprint(np.arange(200) % 50)
    with pytest.raises(DataError, match=r"b\.bin.*other data.*fingerprint"):
        other.restore(position)
    same = TrainData(open_tokens(tmp_path / "a.bin"), layout, seed=0)
    same.restore(position)
    assert same.consumed == data.consumed


def test_a_position_saved_before_fingerprints_is_accepted(tmp_path):
    layout = _layout()
    data = TrainData(_write(tmp_path / "a.bin", np.arange(200) % 50), layout, seed=3)
    data.next_batch()
    older = {key: value for key, value in data.position().items() if key != "fingerprint"}
    resumed = TrainData(_write(tmp_path / "b.bin", np.arange(200) % 50), layout, seed=0)
    resumed.restore(older)
    assert (resumed.consumed, resumed.seed) == (4, 3)


def test_a_run_resumed_on_other_data_of_the_same_length_stops_before_any_step(tmp_path):
    from test_runtime_loop import VOCAB, _bigram_trainable, _run

    from mxc.runtime.loop import LoopConfig
    stream = np.arange(2000) % (VOCAB - 1)
    first = _write(tmp_path / "a.bin", stream, eod_id=VOCAB - 1, vocab_size=VOCAB)
    _run(_bigram_trainable(), first, tmp_path / "ckpt", LoopConfig(steps=3, save_every=3, progress=False))
    shuffled = _write(tmp_path / "b.bin", np.random.default_rng(0).permutation(stream), eod_id=VOCAB - 1,
                      vocab_size=VOCAB)
    with pytest.raises(DataError, match=r"b\.bin: the checkpoint was trained on other data of the same length"):
        _run(_bigram_trainable(), shuffled, tmp_path / "ckpt", LoopConfig(steps=6, save_every=3, progress=False))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()) == ["3"]
