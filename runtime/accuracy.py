"""Teacher-forced token accuracy against a full-precision reference, and serving speed at batch 1.

The method serving stacks publish their accuracy tables with:
1. The reference model runs once over a text (1,024 tokens) and keeps, for every position, its
   five most likely next tokens (`Reference`).
2. The model under test prefills the first `prefill` tokens, then runs `decode` decode steps whose
   input is always the text's next token, never its own prediction: its error accumulates through
   its KV cache, not through sampling. Each step's argmax (and the prefill's) is its prediction.
3. Top-1: the prediction equals the reference's first; top-5: it is among the reference's five.

Both run through the serving functions of a `Servable` (an artifact's prefill/decode, or the
ones jitted from a spec), the functions that generate; speed is measured by the one generation
driver (`runtime.generate.generate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from mxc.runtime.generate import GenerationError, Servable, generate

TOP_K = 5
SEGMENT = 100  # tokens per segment of the per-segment scores
# The speed measurement of the method: a 128-token prompt, then at most 200 decode steps.
SPEED_PROMPT, SPEED_DECODE_STEPS = 128, 200


class AccuracyError(ValueError):
    """A text, reference or size that the measurement cannot use; the message says which."""


@dataclass(frozen=True)
class Reference:
    tokens: np.ndarray  # [n] int32: the text the reference ran over
    top5: np.ndarray  # [n, 5] int32: at position i, the five most likely tokens after tokens[:i + 1], best first

    def save(self, path: str | Path) -> None:
        with open(path, "wb") as f:  # np.savez on a name adds '.npz'; a file object keeps the user's name
            np.savez(f, tokens=self.tokens, top5=self.top5)

    @staticmethod
    def load(path: str | Path) -> "Reference":
        try:
            with np.load(path, allow_pickle=False) as data:
                tokens, top5 = data["tokens"], data["top5"]
        except (OSError, ValueError, KeyError) as err:
            raise AccuracyError(f"{path}: not a reference of mxc eval accuracy (an .npz with 'tokens' "
                                f"and 'top5'): {err}") from None
        if tokens.ndim != 1 or top5.shape != (len(tokens), TOP_K):
            raise AccuracyError(f"{path}: tokens {list(tokens.shape)} and top5 {list(top5.shape)} do not "
                                f"form a reference (top5 must be [tokens, {TOP_K}])")
        return Reference(tokens.astype(np.int32), top5.astype(np.int32))


def check_sizes(servable: Servable, text_tokens: int, prefill: int, decode: int) -> None:
    if prefill < 1 or decode < 0:
        raise AccuracyError(f"--prefill must be at least 1 and --decode at least 0, not {prefill} and {decode}")
    if prefill + decode + 1 > text_tokens:
        raise AccuracyError(f"a prefill of {prefill} and {decode} decode steps score the tokens up to "
                            f"{prefill + decode + 1}; the text has {text_tokens}")
    # The prefill writes all its prompt_len slots (a shorter prompt's padding included).
    needed = max(prefill, servable.prompt_len) + decode
    if needed > servable.cache_len:
        raise AccuracyError(f"{prefill} prefilled + {decode} decoded tokens need a cache of {needed} slots (the "
                            f"prefill writes {servable.prompt_len}); the compiled cache holds {servable.cache_len}")


def teacher_forced_predictions(servable: Servable, params, tokens: np.ndarray, prefill: int,
                               decode: int) -> np.ndarray:
    """The model's argmax after each of tokens[:prefill], tokens[:prefill + 1], ...,
    tokens[:prefill + decode]: [decode + 1] ids. Tokens beyond the compiled prefill width enter the
    cache through decode steps, as the generation driver feeds a long prompt."""
    check_sizes(servable, len(tokens), prefill, decode)
    params = servable.prepare(params)
    width = servable.prompt_len
    prefilled = min(prefill, width)
    prompt = np.zeros((servable.batch, width), np.int32)  # every row the same request
    prompt[:, :prefilled] = tokens[:prefilled]
    logits, cache = servable.prefill(params, prompt, np.full(servable.batch, prefilled, np.int32),
                                     *servable.without_images())
    predictions = []
    for position in range(prefilled, prefill + decode):
        if position >= prefill:
            predictions.append(_argmax(logits))
        fed = np.full(servable.batch, tokens[position], np.int32)  # the text's token, never the prediction
        logits, cache = servable.decode(params, fed, cache)
    predictions.append(_argmax(logits))
    return np.asarray(predictions, np.int32)


def _argmax(logits: jax.Array) -> int:
    row = logits[0] if logits.is_fully_addressable else logits.addressable_data(0)[0]
    return int(np.argmax(np.asarray(jax.device_get(row), np.float32)))


@dataclass(frozen=True)
class Scores:
    top1: float  # percent
    top5: float
    positions: int
    segments: list  # [(first scored position, top1 %, top5 %)] per SEGMENT positions


def score(predictions: np.ndarray, reference: Reference, prefill: int) -> Scores:
    """predictions[j] follows tokens[:prefill + j]: the reference's entry at position prefill - 1 + j."""
    rows = reference.top5[prefill - 1: prefill - 1 + len(predictions)]
    if len(rows) != len(predictions):
        raise AccuracyError(f"the reference covers {len(reference.tokens)} tokens; the scored positions end at "
                            f"{prefill + len(predictions) - 1}")
    hit1 = predictions == rows[:, 0]
    hit5 = (predictions[:, None] == rows).any(axis=1)
    segments = [(prefill + start, 100.0 * hit1[start:start + SEGMENT].mean(),
                 100.0 * hit5[start:start + SEGMENT].mean()) for start in range(0, len(hit1), SEGMENT)]
    return Scores(100.0 * hit1.mean(), 100.0 * hit5.mean(), len(hit1), segments)


def check_reference(reference: Reference, tokens: np.ndarray, source: str) -> None:
    """A stored reference must come from the same tokens (the same text and tokenizer)."""
    n = min(len(reference.tokens), len(tokens))
    differ = np.flatnonzero(reference.tokens[:n] != tokens[:n])
    if differ.size:
        raise AccuracyError(f"{source} was computed over other tokens (first difference at position "
                            f"{differ[0]}): a reference belongs to one text and tokenizer")


@dataclass(frozen=True)
class Speed:
    tokens_per_second_per_user: float
    ttft_ms: float
    prompt_tokens: int
    decode_steps: int
    prefill_width: int  # the compiled prefill the prompt was padded to


def measure_speed(servable: Servable, params, tokens: np.ndarray, prompt: int = SPEED_PROMPT,
                  decode_steps: int = SPEED_DECODE_STEPS) -> Speed:
    """Greedy generation at batch 1 after `prompt` tokens of the text: time to first token and the
    decode rate per user, through the generation driver, after one warm-up request (which compiles
    the sampler: serving numbers are those of a running server)."""
    prompt = min(prompt, len(tokens))
    steps = min(decode_steps, servable.cache_len - max(prompt, servable.prompt_len))
    if steps < 1:
        raise AccuracyError(f"no room for decode steps after a {prompt}-token prompt in a cache of "
                            f"{servable.cache_len} slots")
    request = tokens[None, :prompt].astype(np.int32)
    try:
        generate(servable, params, request, 2)
        _, report = generate(servable, params, request, steps + 1)
    except GenerationError as err:
        raise AccuracyError(str(err)) from None
    return Speed(report.decode_tokens_per_second_per_user or 0.0, report.time_to_first_token_s * 1e3,
                 prompt, steps, servable.prompt_len)
