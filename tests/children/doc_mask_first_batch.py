"""The loss of an artifact's freshly initialised parameters on the first training batch, with and
without document masking, through the runtime's own data pipeline and eval step.

    python doc_mask_first_batch.py ARTIFACT TOKENS SEED

Prints one JSON object: {"doc_mask": loss, "no_doc_mask": loss, "segments": the largest segment id
of the masked batch}."""

import json
import sys

import numpy as np

from mxc.runtime.data import TrainData
from mxc.runtime.program import load
from mxc.runtime.token_file import open_tokens
from mxc.runtime.trainable import from_program


def main(artifact: str, tokens: str, seed: str) -> None:
    trainable = from_program(load(artifact))
    params = trainable.init(int(seed))["params"]
    report = {}
    for name, doc_mask in (("doc_mask", True), ("no_doc_mask", False)):
        batch = TrainData(open_tokens(tokens), trainable.layout, seed=int(seed), doc_mask=doc_mask,
                          vocab_size=trainable.vocab_size).next_batch()
        report[name] = float(np.asarray(trainable.eval_step(params, batch)["loss"]))
        if doc_mask:
            report["segments"] = int(np.asarray(batch["segment_ids"]).max())
    print(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:4])
