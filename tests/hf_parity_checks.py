"""What every HF parity test checks, run through the CLI as a user would: float32 logits against
transformers', that each feature under test bites, greedy decodes, and bit-for-bit export."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mxc.compiler.cli import main

VOCAB, SEQ, PROMPT, NEW = 300, 24, 12, 16
TOLERANCE = 1e-4  # max abs difference, relative to the largest |logit|
BITES = 1e-2  # a feature under test must move the logits at least this much (same scale)


def relative_error(mine: np.ndarray, reference: np.ndarray) -> float:
    return float(np.abs(mine - reference).max() / np.abs(reference).max())


def logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def hf_generate(model, prompt: np.ndarray, new: int = NEW):
    """Greedy tokens from transformers, and the smallest top-2 logit gap met on the way (a near
    tie would make the comparison fragile)."""
    with torch.no_grad():
        out = model.generate(torch.tensor(prompt), attention_mask=torch.ones(prompt.shape, dtype=torch.long),
                             max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    step_logits = torch.stack(out.logits, 1).float().numpy()
    top2 = np.sort(step_logits, axis=-1)[..., -2:]
    return out.sequences.numpy(), float((top2[..., 1] - top2[..., 0]).min())


def weight_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())
            if p.name.endswith(".safetensors") or p.name.endswith(".index.json")}


def check_logits_match(built) -> None:
    logits_path = built.work / "logits.npy"
    assert main(["forward", str(built.out_dir), "--tokens", str(built.work / "tokens.npy"),
                 "-o", str(logits_path)]) == 0
    mine = np.load(logits_path)
    reference = logits(built.model, built.tokens)
    assert mine.dtype == np.float32 and mine.shape == reference.shape == (2, SEQ, VOCAB)
    assert relative_error(mine, reference) < TOLERANCE


def check_features_bite(built, hf_model) -> None:
    """Each feature under test moves the logits far beyond the tolerance, so a bug in it shows."""
    reference = logits(built.model, built.tokens)
    for feature, changes in built.case.ablations.items():
        ablated = hf_model(built.case, **changes)
        ablated.load_state_dict(built.model.state_dict())
        assert relative_error(logits(ablated, built.tokens), reference) > BITES, feature


def check_greedy_generate(built) -> None:
    out = built.work / "generated.npy"
    assert main(["generate", str(built.out_dir), "--prompt-tokens", str(built.work / "prompt.npy"),
                 "--max-new", str(NEW), "--greedy", "-o", str(out)]) == 0
    mine = np.load(out)
    assert mine.shape == (2, PROMPT + NEW)
    np.testing.assert_array_equal(mine, built.hf_sequences)
