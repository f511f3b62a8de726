"""Extracts one novel's lines from Debian's r-cran-janeaustenr package (an R lazy-load database
of character vectors), without R: `apt-get download r-cran-janeaustenr && dpkg-deb -x
r-cran-janeaustenr_*.deb pkg && python extract_janeaustenr.py pkg/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb
prideprejudice OUT.txt`. Each object in Rdata.rdb is a 4-byte big-endian length followed by a zlib
stream of R's XDR serialization; a novel is a character vector, one string per line of the
Project Gutenberg text."""

from __future__ import annotations

import struct
import sys
import zlib

STRSXP, CHARSXP = 16, 9


def objects(rdb: bytes):
    offset = 4
    while offset < len(rdb):
        stream = zlib.decompressobj()
        yield stream.decompress(rdb[offset:])
        offset = len(rdb) - len(stream.unused_data) + 4


def first_character_vector(blob: bytes) -> list[str]:
    """The first STRSXP in a serialized object (a lazy-loaded data object is its vector)."""
    for start in range(0, len(blob) - 8):
        flags, length = struct.unpack(">ii", blob[start:start + 8])
        if flags & 0xFF != STRSXP or length < 1000:
            continue
        lines, at = [], start + 8
        for _ in range(length):
            char_flags, size = struct.unpack(">ii", blob[at:at + 8])
            assert char_flags & 0xFF == CHARSXP, "not a character vector"
            at += 8
            lines.append("" if size < 0 else blob[at:at + size].decode("utf-8"))
            at += max(size, 0)
        return lines
    return []


def main(rdb_path: str, name_hint: str, output: str) -> None:
    rdb = open(rdb_path, "rb").read()
    vectors = [first_character_vector(blob) for blob in objects(rdb)]
    wanted = {"prideprejudice": "PRIDE AND PREJUDICE"}[name_hint]
    novel = next(v for v in vectors if v and v[0].strip().upper() == wanted)
    with open(output, "w", encoding="utf-8") as f:
        f.write("\n".join(novel) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
