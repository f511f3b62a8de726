"""The one sampler against a numpy reference and its distributions, and the generation driver
(groups, prompts shorter than the compiled prefill, limits) on a toy model whose next token is a
known function of the cache."""

import dataclasses
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mxc.runtime.generate import PAD, GenerationError, Servable, generate
from mxc.runtime.sampling import Sampling, next_tokens, restrict


def _reference_kept(logits, temperature, top_k, top_p):
    """Which tokens survive, computed by sorting in numpy: the top_k largest (ties at the k-th
    kept), then the smallest prefix of the rest, by probability, whose mass reaches top_p."""
    scaled = logits.astype(np.float64) / temperature
    kept = np.ones_like(scaled, bool)
    if top_k is not None:
        kth = np.sort(scaled)[::-1][top_k - 1]
        kept &= scaled >= kth
    if top_p is not None:
        order = np.argsort(-np.where(kept, scaled, -np.inf), kind="stable")
        probabilities = np.exp(scaled[order] - scaled[order][0]) * kept[order]
        probabilities /= probabilities.sum()
        mass_above = np.cumsum(probabilities) - probabilities
        chosen = order[mass_above < top_p]
        threshold = scaled[chosen].min()
        kept &= scaled >= threshold
    return kept


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 5, None), (0.7, None, 0.8), (1.3, 10, 0.5),
                                                       (1.0, None, 0.01), (2.0, 50, 1.0)])
def test_restrict_keeps_the_reference_set(temperature, top_k, top_p):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 50)).astype(np.float32) * 3
    got = np.isfinite(np.asarray(restrict(jnp.asarray(logits), Sampling(False, temperature, top_k, top_p))))
    for row in range(4):
        np.testing.assert_array_equal(got[row], _reference_kept(logits[row], temperature, top_k, top_p))


def test_sampling_stays_inside_the_kept_set_and_is_seeded():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(2, 30)), jnp.float32)
    sampling = Sampling(greedy=False, top_k=3)
    allowed = np.argsort(-np.asarray(logits), axis=1)[:, :3]
    requests = np.array([0, 1])
    draws = np.stack([np.asarray(next_tokens(logits, 7, requests, i, sampling=sampling)) for i in range(40)])
    assert all(set(draws[:, row]) <= set(allowed[row]) for row in range(2))
    assert len(set(draws[:, 0])) > 1  # it does sample
    again = np.stack([np.asarray(next_tokens(logits, 7, requests, i, sampling=sampling)) for i in range(40)])
    np.testing.assert_array_equal(draws, again)
    other_seed = np.stack([np.asarray(next_tokens(logits, 8, requests, i, sampling=sampling)) for i in range(40)])
    assert not np.array_equal(draws, other_seed)
    np.testing.assert_array_equal(next_tokens(logits, 0, requests, 0, sampling=Sampling()), np.argmax(logits, axis=1))


def test_a_requests_draws_do_not_depend_on_its_batch():
    """Served alone, or as row 3 of a batch of 5: the same request draws the same tokens."""
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(size=(5, 30)), jnp.float32)
    sampling = Sampling(greedy=False, temperature=1.5)
    batched = np.stack([np.asarray(next_tokens(logits, 3, np.arange(5) + 10, i, sampling=sampling))
                        for i in range(20)])
    alone = np.stack([np.asarray(next_tokens(logits[3:4], 3, np.array([13]), i, sampling=sampling))
                      for i in range(20)])
    np.testing.assert_array_equal(batched[:, 3:4], alone)


LOGITS = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]]))


def _draws(sampling, n=4000):
    """n draws [n, 2] from LOGITS: request ids 0 and 1, token index 0..n-1."""
    return np.stack([np.asarray(next_tokens(LOGITS, 0, np.array([0, 1]), i, sampling=sampling)) for i in range(n)])


def test_top_k_one_is_greedy():
    assert (_draws(Sampling(greedy=False, temperature=3.0, top_k=1), 200) == [0, 3]).all()


def test_unrestricted_sampling_follows_the_softmax_at_its_temperature():
    draws = _draws(Sampling(greedy=False, temperature=0.5), 4000)
    expected = np.asarray(jax.nn.softmax(LOGITS / 0.5, -1))
    for row in range(2):
        frequencies = np.bincount(draws[:, row], minlength=4) / len(draws)
        np.testing.assert_allclose(frequencies, expected[row], atol=0.03)


def test_top_p_keeps_the_smallest_set_reaching_p():
    # Mass before each token, most likely first: 0, 0.5, 0.8, 0.95.
    assert set(_draws(Sampling(greedy=False, top_p=0.7), 400)[:, 0]) == {0, 1}
    assert set(_draws(Sampling(greedy=False, top_p=0.81), 400)[:, 0]) == {0, 1, 2}
    assert set(_draws(Sampling(greedy=False, top_p=0.3), 400)[:, 1]) == {3}


def test_bad_sampling_settings_are_refused():
    with pytest.raises(ValueError, match="temperature"):
        Sampling(greedy=False, temperature=0.0)
    with pytest.raises(ValueError, match="top-p"):
        Sampling(greedy=False, top_p=1.5)


VOCAB = 17


def _toy_servable(batch=2, prompt_len=5, cache_len=12) -> Servable:
    """The next token is (sum of every real token written to the cache so far) mod VOCAB, as
    one-hot logits: the output depends on every prompt token reaching the cache, and on the
    padding being left out."""

    def logits_for(total):
        return jax.nn.one_hot(total % VOCAB, VOCAB) * 10.0

    @jax.jit
    def prefill(params, tokens, lengths):
        real = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
        cache = {"total": jnp.sum(jnp.where(real, tokens, 0), axis=1)}
        return logits_for(cache["total"]), cache

    @jax.jit
    def decode(params, tokens, cache):
        cache = {"total": cache["total"] + tokens}
        return logits_for(cache["total"]), cache

    return Servable(prefill=prefill, decode=decode, abstract_params=None, batch=batch, prompt_len=prompt_len,
                    cache_len=cache_len, vocab_size=VOCAB)


def _toy_reference(prompt, new):
    tokens = list(prompt)
    for _ in range(new):
        tokens.append(sum(tokens) % VOCAB)
    return tokens[len(prompt):]


def test_groups_and_short_prompts_follow_the_reference():
    servable = _toy_servable()
    rows = [[1, 2, 3, 4], [5], [7, 7, 7]]  # 2 groups, every row shorter than the prefill
    prompts = np.full((3, 4), PAD, np.int32)
    for i, row in enumerate(rows):
        prompts[i, :len(row)] = row
    tokens, report = generate(servable, None, prompts, 4)
    assert tokens.shape == (3, 8)
    np.testing.assert_array_equal(tokens[:, :4], prompts)
    for row in range(3):
        assert tokens[row, 4:].tolist() == _toy_reference(rows[row], 4)
    assert (report.requests, report.groups, report.prompt_tokens, report.new_tokens) == (3, 2, 4, 4)
    assert report.time_to_first_token_s > 0 and report.decode_tokens_per_second_per_user > 0


def test_prompts_longer_than_the_prefill_follow_the_reference():
    servable = _toy_servable(prompt_len=3)
    rows = [[1, 2, 3, 4, 5, 6], [5], [7, 7, 7, 7], [2, 9]]  # long and short rows share groups
    prompts = np.full((4, 6), PAD, np.int32)
    for i, row in enumerate(rows):
        prompts[i, :len(row)] = row
    tokens, _ = generate(servable, None, prompts, 4)
    for row in range(4):
        assert tokens[row, 6:].tolist() == _toy_reference(rows[row], 4), row


@pytest.mark.parametrize("prompt, new, message", [
    (np.zeros((1, 11), np.int32), 3, r"11 prompt slots \+ 3 new tokens need a cache of 13 slots"),
    (np.full((1, 3), PAD, np.int32), 3, "prompt row 0 is empty"),
    (np.zeros((1, 4), np.int32), 9, "the compiled cache holds 12"),
    (np.full((1, 4), VOCAB, np.int32), 1, r"prompt ids must lie in \[0, 17\)"),
    (np.zeros((1, 4), np.float32), 1, "integer token ids"),
])
def test_requests_beyond_the_compiled_sizes_are_refused(prompt, new, message):
    with pytest.raises(GenerationError, match=message):
        generate(_toy_servable(), None, prompt, new)


def test_the_first_request_is_timed_after_the_functions_ran_once():
    """A function's first run in a process (XLA:CPU's set-up, a jit's compile) happens in the
    driver's warm-up, before the first request's clock starts, and only once per servable."""
    toy = _toy_servable()
    calls = {"prefill": 0, "decode": 0}

    def prefill(params, tokens, lengths):
        calls["prefill"] += 1
        if calls["prefill"] == 1:
            time.sleep(0.5)  # a cold first run
        return toy.prefill(params, tokens, lengths)

    def decode(params, tokens, cache):
        calls["decode"] += 1
        return toy.decode(params, tokens, cache)

    servable = dataclasses.replace(toy, prefill=prefill, decode=decode)
    tokens, report = generate(servable, None, np.array([[1, 2, 3]], np.int32), 3)
    assert tokens[0, 3:].tolist() == _toy_reference([1, 2, 3], 3)
    assert report.time_to_first_token_s < 0.25
    # The warm-up's prefill and two decode steps (one fed from the host, one from the device), then
    # the request's.
    assert calls == {"prefill": 2, "decode": 4}
    generate(servable, None, np.array([[4]], np.int32), 2)
    assert calls == {"prefill": 3, "decode": 5}  # warmed once


def test_the_next_step_starts_before_the_tokens_reach_the_host(monkeypatch):
    """Where every row goes on from the token just drawn, the next decode step is dispatched with
    it still on the device, and only then is it fetched; not after the first token (its time is the
    time to first token) nor the last (no step follows). The tokens stay those of the reference."""
    import mxc.runtime.generate as driver

    toy = _toy_servable()
    events = []

    def decode(params, tokens, cache):
        events.append("decode on device" if isinstance(tokens, jax.Array) else "decode from host")
        return toy.decode(params, tokens, cache)

    fetch = driver._host
    monkeypatch.setattr(driver, "_host", lambda tokens: (events.append("fetch"), fetch(tokens))[1])
    servable = dataclasses.replace(toy, decode=decode)
    generate(servable, None, np.array([[1, 2]], np.int32), 1)  # the warm-up, then one token: no step
    events.clear()
    tokens, _ = generate(servable, None, np.array([[1, 2, 3]], np.int32), 4)
    assert tokens[0, 3:].tolist() == _toy_reference([1, 2, 3], 4)
    assert events == ["fetch", "decode from host"] + ["decode on device", "fetch"] * 2 + ["fetch"]
