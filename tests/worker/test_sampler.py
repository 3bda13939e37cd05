"""Sampler: greedy, temperature, top-k, top-p and per-request seeds, mixed in one batch."""

from __future__ import annotations

import math

import pytest
import torch

from fastgen.compile import build_op_set, sampling_ops
from fastgen.sampling_params import SamplingParams
from fastgen.sequence import Sequence
from fastgen.worker.sampler import Sampler

VOCAB = 50


def make_sampler(seed=0):
    return Sampler(VOCAB, torch.device("cpu"), seed, build_op_set(False).sample_tokens)


def seqs_for(*params: SamplingParams) -> list[Sequence]:
    return [Sequence(i, [1], p) for i, p in enumerate(params)]


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = random_logits(4)
    tokens = make_sampler()(logits, seqs_for(*[SamplingParams(temperature=0.0)] * 4))
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_top_k_1_equals_greedy_at_any_temperature():
    logits = random_logits(6, seed=1)
    params = [SamplingParams(temperature=t, top_k=1) for t in (0.5, 1.0, 2.0, 5.0, 1.0, 0.7)]
    for seed in range(5):
        tokens = make_sampler(seed)(logits, seqs_for(*params))
        assert tokens.tolist() == logits.argmax(-1).tolist()


def test_fixed_seed_reproduces_regardless_of_batch():
    logits = random_logits(3, seed=2)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = [make_sampler(0)(logits[:1], seqs_for(seeded)).item() for _ in range(1)]
    # Same request, other rows around it, another engine seed: the same draws, step after step.
    solo_seq, batch_seqs = seqs_for(seeded), seqs_for(seeded, SamplingParams(temperature=1.0), SamplingParams(temperature=0.0))
    sampler_a, sampler_b = make_sampler(0), make_sampler(99)
    draws_a = [decode_step(sampler_a, logits[:1], solo_seq)[0] for _ in range(20)]
    draws_b = [decode_step(sampler_b, logits, batch_seqs)[0] for _ in range(20)]
    assert draws_a == draws_b and draws_a[0] == alone[0]
    assert len(set(draws_a)) > 1  # it is sampling, not argmax


def decode_step(sampler, logits, seqs) -> list[int]:
    """Sample a row for each sequence and append it (the next call samples the next position)."""
    tokens = sampler(logits, seqs).tolist()
    for seq, token in zip(seqs, tokens):
        seq.token_ids.append(token)
    return tokens


def test_a_seeded_position_draws_the_same_whichever_step_samples_it():
    """Speculative decoding samples a drafted position in a step with others (offsets), and may
    sample it again after a rejection: a seeded row's token depends on its position alone."""
    logits = random_logits(1, seed=4).expand(3, -1)
    (seq,) = seqs_for(SamplingParams(temperature=1.0, seed=77))
    one_a_step = [decode_step(make_sampler(0), logits[:1], [seq])[0] for _ in range(3)]
    del seq.token_ids[-3:]
    at_once = make_sampler(5)(logits, [seq, seq, seq], offsets=[0, 1, 2]).tolist()
    assert at_once == one_a_step


def test_unseeded_rows_differ_between_engine_seeds():
    logits = torch.zeros(1, VOCAB)
    params = seqs_for(SamplingParams(temperature=1.0))
    a = [make_sampler(1)(logits, params).item() for _ in range(10)]
    b = [make_sampler(2)(logits, params).item() for _ in range(10)]
    assert a != b


def test_params_do_not_leak_between_rows():
    logits = random_logits(3, seed=3)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=1.0, top_p=0.2)]
    top3 = set(logits[1].topk(3).indices.tolist())
    probs2 = torch.softmax(logits[2], -1)
    order = probs2.argsort(descending=True)
    nucleus = set(order[: int((probs2[order].cumsum(0) < 0.2).sum()) + 1].tolist())
    sampler = make_sampler()
    for _ in range(200):
        t = sampler(logits, seqs_for(*params)).tolist()
        assert t[0] == logits[0].argmax().item()
        assert t[1] in top3
        assert t[2] in nucleus


def chi_square_p_value(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Upper tail of the chi-square statistic (Wilson-Hilferty approximation)."""
    stat = float(((observed - expected) ** 2 / expected).sum())
    k = observed.numel() - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.5, -1, 1.0), (1.0, 3, 1.0), (1.0, -1, 0.7)])
def test_empirical_frequencies_match_distribution(temperature, top_k, top_p):
    """Sampling a known 5-token distribution 40,000 times: frequencies pass a chi-square test
    against the distribution after temperature, top-k and top-p are applied."""
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    logits = probs.log().unsqueeze(0)
    target = torch.softmax(probs.log() / temperature, -1)
    if top_k > 0:
        target[top_k:] = 0
    if top_p < 1.0:
        keep = (target.cumsum(0) - target) < top_p
        target = target * keep
    target = target / target.sum()
    n = 40_000
    sampler = Sampler(5, torch.device("cpu"), 7, build_op_set(False).sample_tokens)
    seqs = [Sequence(i, [1], SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)) for i in range(n)]
    tokens = sampler(logits.expand(n, 5), seqs)
    counts = torch.bincount(tokens, minlength=5).float()
    support = target > 0
    assert counts[~support].sum() == 0
    p = chi_square_p_value(counts[support], target[support] * n)
    assert p > 1e-4, f"frequencies {counts.tolist()} do not fit {target.tolist()} (p={p:.2g})"


@pytest.mark.parametrize("temperature,min_p", [(1.0, 0.3), (0.5, 0.3), (2.0, 0.6)])
def test_min_p_keeps_tokens_at_least_min_p_times_the_top_one(temperature, min_p):
    """min_p after temperature (vLLM's order): the kept tokens' frequencies fit their
    renormalised probabilities, and no dropped token is ever drawn."""
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    target = torch.softmax(probs.log() / temperature, -1)
    target = target * (target >= min_p * target.max())
    target = target / target.sum()
    n = 40_000
    sampler = Sampler(5, torch.device("cpu"), 11, build_op_set(False).sample_tokens)
    seqs = [Sequence(i, [1], SamplingParams(temperature=temperature, min_p=min_p)) for i in range(n)]
    counts = torch.bincount(sampler(probs.log().unsqueeze(0).expand(n, 5), seqs), minlength=5).float()
    support = target > 0
    assert counts[~support].sum() == 0 and support.sum() < 5
    p = chi_square_p_value(counts[support], target[support] * n)
    assert p > 1e-4, f"frequencies {counts.tolist()} do not fit {target.tolist()} (p={p:.2g})"


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, 0], logits[0, 5], logits[0, 9] = 9.0, 8.0, 7.0  # EOS, a stop token, then 9
    sampler = Sampler(VOCAB, torch.device("cpu"), 0, build_op_set(False).sample_tokens, eos_token_ids={0})
    for params, want in [
        (SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5]), [9, 9, 9, 0]),
        (SamplingParams(temperature=0.0, min_tokens=2), [5, 5, 0]),
        (SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5], ignore_eos=True), [0, 0, 0]),
        (SamplingParams(temperature=1.0, seed=1, top_k=1, min_tokens=2, stop_token_ids=[5]), [9, 9, 0]),
    ]:
        seq = Sequence(0, [1, 2], params)
        for _ in want:
            seq.token_ids.append(sampler(logits, [seq]).item())
        assert seq.output_token_ids == want, params


# ---- what a request may ask for, the sampler must represent --------------------------------

def test_a_top_k_beyond_int64_keeps_every_token():
    """top_k is clamped to the vocabulary: 2**63 neither overflows the int64 tensor nor filters."""
    logits = random_logits(4, seed=5)
    huge = seqs_for(*[SamplingParams(temperature=1.0, top_k=2**63, seed=s) for s in range(4)])
    unfiltered = seqs_for(*[SamplingParams(temperature=1.0, seed=s) for s in range(4)])
    huge_sampler, unfiltered_sampler = make_sampler(), make_sampler()
    draws = [decode_step(huge_sampler, logits, huge) for _ in range(10)]
    assert draws == [decode_step(unfiltered_sampler, logits, unfiltered) for _ in range(10)]
    assert len({tuple(d) for d in draws}) > 1  # sampling, not argmax


@pytest.mark.parametrize("top_p", [1e-46, 1e-30, 1e-9])
def test_a_tiny_top_p_keeps_the_most_likely_token(top_p):
    """Below ~1e-45 top_p is 0 in float32; the most likely token must still survive (vLLM's rule)
    instead of every token being filtered and the row sampling garbage from NaN."""
    logits = random_logits(8, seed=6)
    logits[:, 0] = -10.0  # the token a NaN row would come back as
    params = [SamplingParams(temperature=1.0, top_p=top_p)] * 8
    sampler = make_sampler()
    for _ in range(20):
        assert sampler(logits, seqs_for(*params)).tolist() == logits.argmax(-1).tolist()


def test_huge_logits_over_a_small_temperature_stay_finite():
    """Finite logits divided by a small temperature overflow in float32, and inf - inf in the
    softmax is NaN: the scaled logits are kept finite, and the top token still wins (the second
    is 1e34 below it, a chance of exp(-5e38)), whatever the draws."""
    logits = torch.zeros(2, VOCAB)
    logits[0, 7], logits[0, 8] = 1e35, 9e34
    logits[1, 9] = float("inf")
    params = [SamplingParams(temperature=2e-5, top_k=5), SamplingParams(temperature=1.0)]
    for seed in range(10):
        assert make_sampler(seed)(logits, seqs_for(*params)).tolist() == [7, 9]


def test_only_the_rows_that_sample_reach_the_sampling_arithmetic():
    """Greedy rows take their argmax and nothing else: one sampled request in a batch must not
    make the others pay for its vocabulary-wide softmax, filter and noise."""
    calls, eager = [], build_op_set(False).sample_tokens

    def spy(logits, *args):
        calls.append(logits.shape[0])
        return eager(logits, *args)

    logits = random_logits(8, seed=6)
    params = [SamplingParams(temperature=0.0)] * 6 + [SamplingParams(temperature=1.0, top_p=0.5, seed=3),
                                                      SamplingParams(temperature=0.0)]
    tokens = Sampler(VOCAB, torch.device("cpu"), 0, spy)(logits, seqs_for(*params))
    assert calls == [1]
    greedy_rows = [0, 1, 2, 3, 4, 5, 7]
    assert tokens[greedy_rows].tolist() == logits[greedy_rows].argmax(-1).tolist()
    alone = make_sampler(9)(logits[6:7], seqs_for(params[6])).item()
    assert tokens[6].item() == alone  # a seeded row draws the same whatever shares its batch


LARGE_VOCAB = 4096  # large enough that the CPU filter looks at candidates before sorting


@pytest.mark.parametrize("spread", ["peaked", "flat"])
def test_the_nucleus_filter_keeps_what_transformers_warpers_keep(spread, monkeypatch):
    """Top-k then top-p keep exactly the tokens transformers' TopKLogitsWarper then
    TopPLogitsWarper keep, on the CPU filter's partial top-k and on its whole sort alike: rows
    with a top-k past its candidates are sorted whole, and so is a top-p row whose nucleus
    reaches past them (flat rows), but not one whose nucleus lies among them (peaked rows). A
    row that asks for top-k alone keeps all k, however its mass rounds."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(7, LARGE_VOCAB, generator=torch.Generator().manual_seed(5))
    logits *= 6.0 if spread == "peaked" else 0.3
    settings = [(LARGE_VOCAB, 0.9), (40, 1.0), (40, 0.5), (300, 0.95), (LARGE_VOCAB, 0.3), (1000, 1.0), (1, 0.9)]
    top_k = torch.tensor([k for k, _ in settings])
    top_p = torch.tensor([p for _, p in settings])
    sorted_rows, sort_whole = [], sampling_ops._filter_sorted

    def counting(rows, *args):
        sorted_rows.append(rows.shape[0])
        return sort_whole(rows, *args)

    monkeypatch.setattr(sampling_ops, "_filter_sorted", counting)
    ours = sampling_ops.filter_top_k_top_p(logits, top_k, top_p)
    assert sorted_rows == ([2] if spread == "peaked" else [4])
    for row, (k, p) in enumerate(settings):
        want = logits[row : row + 1]
        if k < LARGE_VOCAB:
            want = TopKLogitsWarper(k)(None, want)
        if p < 1.0:
            want = TopPLogitsWarper(p)(None, want)
        kept = torch.isfinite(want[0])
        assert torch.equal(torch.isfinite(ours[row]), kept), (row, int(kept.sum()), int(torch.isfinite(ours[row]).sum()))
        assert torch.equal(ours[row][kept], logits[row][kept])
    assert torch.equal(ours, sort_whole(logits, top_k, top_p))


def test_a_uniform_draw_of_zero_cannot_pick_a_banned_token(monkeypatch):
    """-log(U) with U = 0 would be an infinite draw: in a row where one token is allowed (top-k 1
    here; a grammar alike), every other token's chance is 0, and an all-zero race would pick
    token 0. The only allowed token must win whatever the draws."""
    logits = random_logits(2, seed=8)
    assert logits[0].argmax() != 0
    real_rand = torch.rand

    def zeros(*args, **kwargs):
        return real_rand(*args, **kwargs).zero_()

    monkeypatch.setattr(torch, "rand", zeros)
    params = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_k=1, seed=5)]
    tokens = make_sampler()(logits, seqs_for(*params))
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_a_rows_filter_does_not_depend_on_what_shares_its_batch():
    """Which way the CPU filter takes a row (its candidates or a whole sort) follows from the
    row alone: a top-p row gets the same tokens beside rows with large top-k's as on its own, so
    a seeded request reproduces in any batch."""
    logits = torch.randn(8, LARGE_VOCAB, generator=torch.Generator().manual_seed(11))
    logits[:4] *= 6.0  # peaked rows: their nucleus lies among the candidates
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.7, 0.9, 0.5, 0.95, 0.7])
    top_k = torch.full((8,), LARGE_VOCAB)
    batch = sampling_ops.filter_top_k_top_p(torch.cat([logits, logits[:2]]), torch.cat([top_k, torch.tensor([1000, 3000])]),
                                            torch.cat([top_p, torch.tensor([1.0, 0.9])]))
    for row in range(8):
        alone = sampling_ops.filter_top_k_top_p(logits[row : row + 1], top_k[row : row + 1], top_p[row : row + 1])
        assert torch.equal(batch[row], alone[0]), row
