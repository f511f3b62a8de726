"""A token file's content fingerprint: a header that carries a malformed one is refused when the
file is opened, naming it, rather than compared against a checkpoint later."""
import json
import struct

import numpy as np
import pytest

from mxc.runtime.token_file import MAGIC, TokenFileError, open_tokens


def test_a_header_fingerprint_that_is_no_sha256_digest_is_refused_naming_the_file(tmp_path):
    header = {"dtype": "uint16", "tokens": 2, "eod_id": None, "vocab_size": 9, "tokenizer": "t",
              "fingerprint": "not-a-digest"}
    text = json.dumps(header).encode()
    path = tmp_path / "tokens.bin"
    path.write_bytes(MAGIC + struct.pack("<I", len(text)) + text + np.array([1, 2], "<u2").tobytes())
    with pytest.raises(TokenFileError, match=r"tokens\.bin: header fingerprint 'not-a-digest' is not a sha256"):
        open_tokens(path)
