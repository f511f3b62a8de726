"""The one generation driver: batched requests through a prefill and a decode step, sampling,
timings. It runs an artifact's precompiled executables (`mxc compile --serve`) and, with the same
code, the functions `mxc generate MODEL` jits from a spec.

The functions have fixed sizes: `batch` rows, a prefill of `prompt_len` tokens and a KV cache of
`cache_len` slots. Requests are served in groups of `batch` rows (the last group filled up with
copies of its first row, whose outputs are dropped). Prompts may be shorter than `prompt_len` and
of different lengths: a prompt array marks the end of a shorter row with PAD (-1) ids after its
tokens. Each row is right-padded to `prompt_len`, prefilled, and goes on from its own last token
(the prefill's lengths argument; see compiler/lower/decode.py). A row longer than `prompt_len`
has its first prompt_len tokens prefilled and the rest fed through decode steps, one per step,
while shorter rows of its group already generate. The cache takes prompt_len slots and then one
per decode step, so max(longest prompt, prompt_len) + max_new - 1 must fit; an empty prompt is
refused.

Timings follow serving benchmarks: time to first token (request start to the first new token
on the host, prefill included) and, per user, the decode rate after that (each row of a group
gets one token per decode step).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Callable

import jax
import numpy as np

from mxc.runtime.sampling import Sampling, next_tokens, warm

PREFILL_FUNCTION, DECODE_FUNCTION = "prefill", "decode"
PAD = -1  # a prompt array's filler after the tokens of a row shorter than the array


class GenerationError(ValueError):
    """Requests that these executables cannot serve; the message says which size is the limit."""


@dataclass(frozen=True)
class Servable:
    prefill: Callable  # (params, tokens [batch, prompt_len], lengths [batch][, images]) -> (logits [batch, vocab], cache)
    decode: Callable  # (params, tokens [batch], cache) -> (logits, cache); consumes the cache
    abstract_params: object  # ShapeDtypeStructs with this mesh's shardings (None: params are given as arrays)
    batch: int
    prompt_len: int
    cache_len: int
    vocab_size: int
    # A checkpoint's parameters (as abstract_params lays them out) -> those prefill and decode take:
    # one array per layer where they were compiled so (runtime/layer_layout.py).
    prepare: Callable = lambda params: params  # noqa: E731
    # A vision model's artifact: the image slots its prefill takes as a fourth argument
    # (runtime/serving_images.py); None: the prefill takes no images (or has them built in).
    image_slots: object = None

    def without_images(self) -> tuple:
        """The prefill's arguments after lengths for a batch of text alone: every image slot empty."""
        return () if self.image_slots is None else (self.image_slots.empty(self.batch),)


@dataclass(frozen=True)
class GenerationReport:
    requests: int
    groups: int
    prompt_tokens: int  # per request, the longest
    new_tokens: int  # per request
    time_to_first_token_s: float  # mean over groups
    decode_tokens_per_second_per_user: float | None  # None when only one token was generated
    total_tokens_per_second: float  # new tokens of all requests over the whole time
    seconds: float

    def to_json(self) -> dict:
        return dict(self.__dict__)


def servable_from_program(program) -> Servable:
    from mxc.runtime.layer_layout import all_per_layer, stacked_abstract
    from mxc.runtime.serving_images import image_slots_of
    from mxc.runtime.trainable import abstract_argument

    functions = program.functions
    missing = [name for name in (PREFILL_FUNCTION, DECODE_FUNCTION) if name not in functions]
    if missing:
        raise GenerationError(f"{program.directory} has no {' or '.join(missing)} function: compile it with --serve")
    run = program.manifest.run
    abstract = abstract_argument(functions[PREFILL_FUNCTION], 0)
    if all_per_layer(abstract):  # compiled for one array per layer; checkpoints stay stacked
        abstract = stacked_abstract(abstract)
    return Servable(prefill=functions[PREFILL_FUNCTION], decode=functions[DECODE_FUNCTION],
                    abstract_params=abstract, batch=run["serve_batch"], prompt_len=run["prompt_len"],
                    cache_len=run["cache_len"], vocab_size=program.manifest.spec["vocab"],
                    prepare=functions[PREFILL_FUNCTION].params_as_taken,
                    image_slots=image_slots_of(program.manifest, functions[PREFILL_FUNCTION].function))


def prompt_lengths(servable: Servable, prompts: np.ndarray, max_new: int) -> np.ndarray:
    """Each request's prompt length [requests], after checking the requests fit these functions."""
    if prompts.ndim != 2 or prompts.dtype.kind not in "iu":
        raise GenerationError(f"prompts must be integer token ids of shape (requests, prompt), "
                              f"not {prompts.dtype}{list(prompts.shape)}")
    if max_new < 1:
        raise GenerationError(f"--max-new must be at least 1, not {max_new}")
    real = prompts != PAD
    lengths = real.sum(axis=1)
    gaps = [row for row in range(len(prompts)) if not real[row, :lengths[row]].all()]
    if gaps:
        raise GenerationError(f"prompt row {gaps[0]} has ids after its padding ({PAD}): pad rows at the end only")
    empty = np.flatnonzero(lengths == 0)
    if empty.size:
        raise GenerationError(f"prompt row {empty[0]} is empty: every prompt needs at least one token")
    if prompts.size and (prompts[real].min() < 0 or prompts[real].max() >= servable.vocab_size):
        raise GenerationError(f"prompt ids must lie in [0, {servable.vocab_size}) ({PAD} pads a shorter row)")
    slots = max(int(lengths.max(initial=0)), servable.prompt_len)
    if slots + max_new - 1 > servable.cache_len:
        raise GenerationError(f"{slots} prompt slots + {max_new} new tokens need a cache of "
                              f"{slots + max_new - 1} slots; the compiled cache holds {servable.cache_len}")
    return lengths


def _host(tokens: jax.Array) -> np.ndarray:
    """The generated ids on this host (replicated over processes by the sampler's jit)."""
    return np.asarray(jax.device_get(tokens) if tokens.is_fully_addressable
                      else tokens.addressable_data(0))


# The logits of each prefill's warm-up and of the decode step after it, by prefill function.
_WARMED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def warm_up(servable: Servable, params, sampling: Sampling = Sampling(), seed: int = 0) -> None:
    """Run the prefill and two decode steps once on a dummy prompt, as a server warms up before
    it takes requests: an executable's first run in a process pays for setting up XLA:CPU's
    threads and buffers (a 128-token prefill of a 20M model: 45-70 ms of CPU against 20-25 ms
    warm, docs/runtime.md), which would otherwise land in the first request's time to first token.
    The sampler is compiled on those steps' own logits: jit compiles for its arguments' shardings,
    and a program's logits carry the program's (warmed on a fresh array instead, the first request
    compiled it again: 33 ms of CPU at llama-20m, under load)."""
    logits = _WARMED.get(servable.prefill)
    if logits is None:
        tokens = np.zeros((servable.batch, servable.prompt_len), np.int32)
        lengths = np.ones(servable.batch, np.int32)
        first, cache = servable.prefill(params, tokens, lengths, *servable.without_images())
        after, cache = servable.decode(params, np.zeros(servable.batch, np.int32), cache)
        # Later steps take the sampler's tokens still on the device (`_step_ahead`): a jitted
        # decode compiles for their sharding here, not inside the first request.
        chosen = next_tokens(after, seed, np.arange(servable.batch), np.zeros(servable.batch, np.int32),
                             sampling=sampling)
        _, cache = servable.decode(params, chosen, cache)
        jax.block_until_ready((first, after, cache))
        logits = _WARMED[servable.prefill] = (first, after)
    for step_logits in logits:
        warm(step_logits, sampling, seed)


def _step_ahead(servable: Servable, params, chosen: jax.Array, cache, fed, length, made_after, max_new: int):
    """The next decode step, dispatched with the tokens just drawn while they are still on the
    device, where they are exactly what every row feeds next (no row still feeding its prompt, one
    row at least not finished): the host's work between steps (fetching the tokens, placing the
    next call's arguments) then overlaps the step running instead of leaving the cores idle
    (docs/runtime.md, "The decode loop on the host"). None where the next feed needs the host. A
    group stopped early by its caller has run one step more than it uses; nothing reads it."""
    if not chosen.is_fully_addressable or (fed < length).any() or (made_after >= max_new).all():
        return None
    return servable.decode(params, chosen, cache)


# on_tokens(requests, tokens) -> stop: called with the requests that got a new token at this step
# and those tokens, as soon as they reach the host; True ends the group's generation there.
OnTokens = Callable[[np.ndarray, np.ndarray], bool]


def generate(servable: Servable, params, prompts: np.ndarray, max_new: int, *,
             sampling: Sampling = Sampling(), seed: int = 0, on_tokens: OnTokens | None = None,
             images: dict | None = None) -> tuple[np.ndarray, GenerationReport]:
    """Prompts [requests, width] (rows ending in PAD where shorter) -> (the prompt array followed by
    max_new new tokens per row, [requests, width + max_new]; timings). A group stopped early by
    `on_tokens` (a streaming caller at its end-of-sequence token) has PAD in the slots it did not fill.
    `images`: each request's image slots ([requests, ...], ImageSlots.place) for a servable whose
    prefill takes them; without, its slots are empty."""
    lengths = prompt_lengths(servable, prompts, max_new)
    if images is not None and servable.image_slots is None:
        raise GenerationError("these executables take no images (a vision model's artifact of mxc compile --serve "
                              "does)")
    if servable.image_slots is not None and images is None:
        images = servable.image_slots.empty(len(prompts))
    params = servable.prepare(params)  # once per call; a caller serving many may prepare them itself
    requests, width = prompts.shape
    prompt_len = servable.prompt_len
    prefilled = np.minimum(lengths, prompt_len).astype(np.int32)
    padded = np.zeros((requests, max(width, prompt_len)), np.int32)
    padded[:, :width] = np.where(prompts == PAD, 0, prompts)
    warm_up(servable, params, sampling, seed)
    started = time.perf_counter()
    outputs, first_token_times, decode_seconds, decoded = [], [], 0.0, 0
    groups = -(-requests // servable.batch)
    for group in range(groups):
        first, end = group * servable.batch, min((group + 1) * servable.batch, requests)
        fill = servable.batch - (end - first)
        rows = np.concatenate([np.arange(first, end), np.full(fill, first)])  # request served by each row
        group_started = time.perf_counter()
        group_images = () if images is None else ({name: value[rows] for name, value in images.items()},)
        logits, cache = servable.prefill(params, padded[rows, :prompt_len], prefilled[rows], *group_images)
        fed, length = prefilled[rows].copy(), lengths[rows]
        new = np.full((servable.batch, max_new), PAD, np.int32)
        made = np.zeros(servable.batch, np.int32)  # new tokens of each row so far
        first_at = None
        while True:
            # A row whose whole prompt is in the cache takes its next token from these logits.
            ready = (fed == length) & (made < max_new)
            chosen = next_tokens(logits, seed, rows, np.minimum(made, max_new - 1), sampling=sampling)
            # Not before the first token: the time to first token stays the prefill's and the
            # sampler's alone, and every decode step runs inside the decode rate's window.
            ahead = (None if first_at is None
                     else _step_ahead(servable, params, chosen, cache, fed, length, made + ready, max_new))
            token = _host(chosen)
            new[ready, made[ready]] = token[ready]
            made += ready
            if first_at is None and made.all():
                first_at = time.perf_counter()  # waiting on the host bounds the steps in flight, too
                first_token_times.append(first_at - group_started)
            stop = on_tokens is not None and bool(on_tokens(rows[:end - first][ready[:end - first]],
                                                            token[:end - first][ready[:end - first]]))
            if (made == max_new).all() or stop:
                if first_at is None:
                    first_at = time.perf_counter()
                    first_token_times.append(first_at - group_started)
                break
            if ahead is not None:
                logits, cache = ahead
                continue
            feeding = fed < length
            feed = np.where(feeding, padded[rows, np.minimum(fed, padded.shape[1] - 1)],
                            new[np.arange(servable.batch), np.maximum(made - 1, 0)])
            fed += feeding
            logits, cache = servable.decode(params, feed.astype(np.int32), cache)
        decode_seconds += time.perf_counter() - first_at
        decoded += int(made.max()) - 1  # a user's tokens after its first (fewer when stopped early)
        outputs.append(new[:end - first])
    seconds = time.perf_counter() - started
    report = GenerationReport(
        requests=requests, groups=groups, prompt_tokens=int(lengths.max()), new_tokens=max_new,
        time_to_first_token_s=float(np.mean(first_token_times)),
        decode_tokens_per_second_per_user=(decoded / decode_seconds if decoded > 0 and decode_seconds > 0
                                           else None),
        total_tokens_per_second=requests * max_new / seconds, seconds=seconds)
    dtype = np.result_type(prompts.dtype, np.int32)
    return np.concatenate([prompts.astype(dtype), np.concatenate(outputs).astype(dtype)], axis=1), report
