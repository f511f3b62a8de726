"""Token files that are not what they claim are refused when opened, naming the file (issue 22)."""
import json
import struct

import numpy as np
import pytest

from mxc.runtime.token_file import MAGIC, TokenFileError, open_tokens


@pytest.mark.parametrize("header", [[1, 2], "text", 7, None])
def test_a_header_that_is_no_json_object_is_refused_naming_the_file(tmp_path, header):
    path = tmp_path / "tokens.bin"
    text = json.dumps(header).encode()
    path.write_bytes(MAGIC + struct.pack("<I", len(text)) + text)
    with pytest.raises(TokenFileError, match=r"tokens\.bin: header is not a JSON object"):
        open_tokens(path)


@pytest.mark.parametrize("tokens", [np.array([3, -1, 2], np.int32),
                                    np.array([3, 2**63, 2], np.uint64)])
def test_npy_ids_outside_the_int64_range_are_refused_at_open(tmp_path, tokens):
    path = tmp_path / "tokens.npy"
    np.save(path, tokens)
    with pytest.raises(TokenFileError, match=r"tokens\.npy: token ids must lie in"):
        open_tokens(path)


def test_an_out_of_vocabulary_id_in_a_bin_is_refused_before_any_window_is_drawn(tmp_path):
    from mxc.runtime.data import DataError, PackedSequences
    from mxc.runtime.token_file import write_tokens
    path = tmp_path / "tokens.bin"
    write_tokens(path, [np.arange(100) % 40], vocab_size=41, eod_id=None, tokenizer=None)
    with open(path, "r+b") as f:  # a damaged id in the last window, which an early step would not draw
        f.seek(-3 * 2, 2)
        f.write(np.array([45], np.uint16).tobytes())
    with pytest.raises(DataError, match=r"tokens\.bin: token id 45 is outside the model's vocabulary of 41"):
        PackedSequences(open_tokens(path), seq=8, vocab_size=41)
