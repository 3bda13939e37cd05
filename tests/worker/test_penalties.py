"""Penalties over device token counts: the arithmetic against float64 references, the counts
against the sequences' tokens, and the sampler's mixing of penalised and plain rows."""

from __future__ import annotations

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from fastgen.compile import build_op_set
from fastgen.compile.sampling_ops import apply_penalties
from fastgen.sampling_params import SamplingParams
from fastgen.sequence import Sequence
from fastgen.worker.penalties import TokenCounts
from fastgen.worker.sampler import Sampler

VOCAB = 50
CPU = torch.device("cpu")


def random_counts(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 4, (rows, VOCAB), generator=g, dtype=torch.int32)
    counts[torch.rand(rows, VOCAB, generator=g) < 0.6] = 0
    return counts, torch.rand(rows, VOCAB, generator=g) < 0.2


def test_presence_and_frequency_match_float64_openai_formula():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, VOCAB, generator=g) * 5
    counts, prompt = random_counts(4, seed=1)
    rows = torch.tensor([0, 2, 3, 5])
    slots = torch.tensor([3, 0, 2, 1])
    frequency = torch.tensor([0.5, -1.2, 2.0, 0.0])
    presence = torch.tensor([1.5, 0.3, -2.0, 0.7])
    got = apply_penalties(logits, rows, slots, counts, prompt, torch.ones(4), frequency, presence)
    want = logits.double().clone()
    for row, slot, f, p in zip(rows.tolist(), slots.tolist(), frequency.double(), presence.double()):
        c = counts[slot].double()
        want[row] -= c * f + (c > 0).double() * p
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-5)
    assert torch.equal(got[[1, 4]], logits[[1, 4]])  # rows without penalties are untouched


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_transformers_processor(penalty):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, VOCAB, generator=g) * 4
    histories = [[1, 4, 4, 9], [0, 49, 7], [3, 3, 3, 12, 30]]
    prompt_lens = [2, 3, 1]
    counts = TokenCounts(VOCAB, CPU)
    seqs = []
    for i, (history, n) in enumerate(zip(histories, prompt_lens)):
        seq = Sequence(i, history[:n], SamplingParams(repetition_penalty=penalty))
        seq.token_ids += history[n:]
        seqs.append(seq)
    slots = counts.slots(seqs)
    got = apply_penalties(logits, torch.arange(3), slots, counts.output_counts, counts.prompt_mask,
                          torch.full((3,), penalty), torch.zeros(3), torch.zeros(3))
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    for row, history in enumerate(histories):  # transformers penalises the whole sequence
        want = processor(torch.tensor([history]), logits[row : row + 1].clone())
        assert torch.equal(got[row], want[0])


def test_counts_follow_the_sequences_tokens_through_growth_release_and_refill():
    counts = TokenCounts(VOCAB, CPU, initial_capacity=2)
    seqs = [Sequence(i, [i, i + 1, 7], SamplingParams(presence_penalty=1.0)) for i in range(5)]
    g = torch.Generator().manual_seed(3)
    for step in range(6):
        live = seqs if step < 3 else seqs[::2]
        if step == 3:
            counts.release([1, 3])  # finished or preempted: their slots go back
        slots = counts.slots(live)
        tokens = torch.randint(0, VOCAB, (len(live),), generator=g)
        counts.count(slots, tokens)
        for seq, token in zip(live, tokens.tolist()):
            seq.token_ids.append(token)
    assert counts.capacity >= 5
    for seq in seqs[::2]:
        slot = counts.slot_of[seq.seq_id]
        want = torch.bincount(torch.tensor(seq.output_token_ids), minlength=VOCAB).int()
        assert torch.equal(counts.output_counts[slot], want)
        assert counts.prompt_mask[slot].nonzero().flatten().tolist() == sorted(set(seq.token_ids[:3]))
    counts.release([0])
    refilled = counts.slots([seqs[0]])  # preempted and back: filled again from its tokens
    want = torch.bincount(torch.tensor(seqs[0].output_token_ids), minlength=VOCAB).int()
    assert torch.equal(counts.output_counts[refilled[0]], want)


def test_one_sampler_call_penalises_only_its_penalised_rows():
    """The same rows, in one call or each alone, give the same tokens, step after step: counts
    of one row never reach another, and plain rows stay plain."""
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, frequency_penalty=2.0),
              SamplingParams(temperature=1.0, seed=4, presence_penalty=1.5, repetition_penalty=1.8),
              SamplingParams(temperature=1.0, seed=5)]
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(5)) * 2
    batch = Sampler(VOCAB, CPU, 0, build_op_set(False).sample_tokens)
    solo = [Sampler(VOCAB, CPU, 0, build_op_set(False).sample_tokens) for _ in params]
    seqs = [Sequence(i, [1, 2], p) for i, p in enumerate(params)]
    solo_seqs = [Sequence(i, [1, 2], p) for i, p in enumerate(params)]
    for _ in range(12):
        together = batch(logits, seqs).tolist()
        apart = [s(logits[i : i + 1], [solo_seqs[i]]).item() for i, s in enumerate(solo)]
        assert together == apart
        for seq, other, token in zip(seqs, solo_seqs, together):
            seq.token_ids.append(token)
            other.token_ids.append(token)
    assert len(set(seqs[0].output_token_ids)) == 1  # plain greedy repeats its argmax
    assert len(set(seqs[1].output_token_ids)) > 3  # the frequency penalty walks away from it
