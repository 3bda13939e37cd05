"""Host-side cost of one decode step with 256 running sequences (group `host-step`).

Everything the CPU does per step besides the model: scheduling and block bookkeeping, building
the step's inputs, and the engine's per-request work. Target: well under 1 ms per step at 256
sequences, so that a CUDA-graph decode step (a few ms for a small model) is not host-bound.

The state is steady: 256 sequences with prompts of 100-1000 tokens (a shared 64-token system
prompt, prefix caching on) have been prefilled and have decoded WARM_STEPS tokens; each round is
one real decode step on them. After LAP_STEPS measured steps the state is rebuilt (untimed), so
sequences never drift far from those lengths. Tokens are fake (no model runs).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fastgen import LLM, SamplingParams
from fastgen.engine.block_manager import BlockManager
from fastgen.engine.scheduler import Scheduler
from fastgen.scheduler_output import SchedulerOutput
from fastgen.sequence import Sequence
from fastgen.step_runner import ModelRunnerOutput
from fastgen.worker.step_inputs import StepInputBuilder
from tests.tiny_models import build_tokenizer, model_config

NUM_SEQS = 256
PROMPT_LENS = (100, 1000)
SYSTEM_PROMPT_LEN = 64
WARM_STEPS = 32  # decode steps before measuring: outputs are under way, the builder's rows primed
LAP_STEPS = 64  # measured steps between rebuilds
MAX_MODEL_LEN = 4096
MAX_BATCHED_TOKENS = 8192
VOCAB = 151_936  # Qwen's: token ids drawn from it for the scheduler-level benchmarks
ROUNDS = 256
WARMUP_ROUNDS = 8

BLOCK_SIZES = [pytest.param(16, id="block16"), pytest.param(256, id="block256")]


def random_prompts(rng: np.random.Generator, vocab: int) -> list[list[int]]:
    system = rng.integers(1, vocab, SYSTEM_PROMPT_LEN).tolist()
    lengths = rng.integers(PROMPT_LENS[0], PROMPT_LENS[1] + 1, NUM_SEQS)
    return [system + rng.integers(1, vocab, n - SYSTEM_PROMPT_LEN).tolist() for n in lengths]


def kv_blocks_for(block_size: int) -> int:
    """Room for every sequence to reach its longest length during a lap, plus slack."""
    longest = PROMPT_LENS[1] + WARM_STEPS + LAP_STEPS + 2
    return NUM_SEQS * (-(-longest // block_size)) + 64


def fake_tokens(rng: np.random.Generator, vocab: int) -> list[list[int]]:
    """One list of NUM_SEQS sampled tokens per step of a lap."""
    return rng.integers(1, vocab, (WARM_STEPS + LAP_STEPS + 1, NUM_SEQS)).tolist()


class DecodeBatch:
    """A Scheduler + BlockManager + StepInputBuilder holding NUM_SEQS sequences in decode."""

    def __init__(self, block_size: int, seed: int = 0):
        self.block_size = block_size
        self.rng = np.random.default_rng(seed)
        self.tokens = fake_tokens(self.rng, VOCAB)
        self.builder = StepInputBuilder(
            NUM_SEQS, MAX_BATCHED_TOKENS, -(-MAX_MODEL_LEN // block_size), block_size, torch.device("cpu"),
        )
        self.params = SamplingParams(temperature=0.0, max_tokens=MAX_MODEL_LEN, ignore_eos=True)
        self.next_seq_id = 0
        self.reset()

    def reset(self) -> None:
        bm = BlockManager(kv_blocks_for(self.block_size), self.block_size, enable_prefix_caching=True)
        self.scheduler = Scheduler(bm, NUM_SEQS, MAX_BATCHED_TOKENS, MAX_MODEL_LEN, eos_token_ids=())
        for prompt in random_prompts(self.rng, VOCAB):
            self.scheduler.add(Sequence(self.next_seq_id, prompt, self.params))
            self.next_seq_id += 1
        while True:
            out = self.scheduler.schedule()
            if not out.is_prefill:
                break
            self.scheduler.postprocess(out, [7 if out.samples(i) else None for i in range(len(out.seqs))])
        self.scheduler.postprocess(out, self.tokens[0])  # close the decode step just scheduled
        self.steps = 1
        for _ in range(WARM_STEPS):
            self.full_step()
        self.measured = 0

    def before_round(self) -> None:
        """pedantic() setup: rebuild once a lap is over; the round itself is always a real step."""
        if self.measured >= LAP_STEPS:
            self.reset()
        self.measured += 1

    def _sampled(self) -> list[int]:
        tokens = self.tokens[self.steps % len(self.tokens)]
        self.steps += 1
        return tokens

    # ---- what the benchmarks time ---------------------------------------------------------
    def schedule_and_postprocess(self) -> None:
        out = self.scheduler.schedule()
        assert not out.is_prefill and len(out.seqs) == NUM_SEQS
        self.scheduler.postprocess(out, self._sampled())

    def schedule_only(self):
        """setup of the build_decode benchmark: returns the (args, kwargs) it times."""
        self.before_round()
        out = self.scheduler.schedule()
        assert not out.is_prefill and len(out.seqs) == NUM_SEQS
        return (out,), {}

    def schedule_with_one_left_out(self):
        """setup of the churn benchmark: the step's batch less one sequence from the middle, a
        different one each round, as when a request finishes or is aborted mid-batch (every row
        after it moves up one). The full step is still postprocessed, so the state stays steady."""
        (out,), _ = self.schedule_only()
        self.full_out = out
        gap = NUM_SEQS // 4 + (self.steps * 37) % (NUM_SEQS // 2)
        keep = [i for i in range(len(out.seqs)) if i != gap]
        subset = SchedulerOutput([out.seqs[i] for i in keep], [1] * len(keep), False,
                                 [out.new_tables[i] for i in keep], [out.new_block_ids[i] for i in keep],
                                 out.preempted_seq_ids, out.finished_seq_ids,
                                 starts=tuple(out.starts[i] for i in keep), sampling=(True,) * len(keep))
        return (subset,), {}

    def postprocess_full_step(self, _out) -> None:
        self.scheduler.postprocess(self.full_out, self._sampled())

    def postprocess_only(self, out) -> None:
        self.scheduler.postprocess(out, self._sampled())

    def full_step(self) -> None:
        out = self.scheduler.schedule()
        assert not out.is_prefill and len(out.seqs) == NUM_SEQS
        self.builder.build_decode(out)
        self.scheduler.postprocess(out, self._sampled())

    def describe(self) -> dict:
        lens = [len(s) for s in self.scheduler.running]
        return {
            "num_seqs": NUM_SEQS,
            "block_size": self.block_size,
            "mean_seq_len": round(sum(lens) / len(lens)),
            "kv_blocks": self.scheduler.block_manager.num_blocks,
            "prefix_caching": True,
        }


@pytest.mark.benchmark(group="host-step")
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_schedule_and_postprocess(benchmark, block_size):
    """Scheduler.schedule() + Scheduler.postprocess(): the scheduling and block bookkeeping."""
    batch = DecodeBatch(block_size)
    benchmark.extra_info.update(batch.describe())
    benchmark.pedantic(
        batch.schedule_and_postprocess, setup=batch.before_round, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS
    )


@pytest.mark.benchmark(group="host-step")
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_build_decode_inputs(benchmark, block_size):
    """StepInputBuilder.build_decode() for 256 sequences (CPU: no transfer)."""
    batch = DecodeBatch(block_size)
    benchmark.extra_info.update(batch.describe())
    benchmark.pedantic(
        batch.builder.build_decode, setup=batch.schedule_only, teardown=batch.postprocess_only,
        rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS,
    )


@pytest.mark.benchmark(group="host-step")
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_build_decode_inputs_after_a_mid_batch_exit(benchmark, block_size):
    """build_decode() when the batch differs from the previous step's by one sequence gone from
    the middle: the rows after it now hold other sequences."""
    batch = DecodeBatch(block_size)
    benchmark.extra_info.update(batch.describe())
    benchmark.pedantic(
        batch.builder.build_decode, setup=batch.schedule_with_one_left_out, teardown=batch.postprocess_full_step,
        rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS,
    )


@pytest.mark.benchmark(group="host-step")
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_scheduler_and_inputs(benchmark, block_size):
    """schedule() + build_decode() + postprocess(): the two above in one step."""
    batch = DecodeBatch(block_size)
    benchmark.extra_info.update(batch.describe())
    benchmark.pedantic(batch.full_step, setup=batch.before_round, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS)


# ---- the whole engine step, model stubbed out ------------------------------------------------
def write_stub_model(folder) -> str:
    """A 1-layer, 1-KV-head Qwen3 config with the test tokenizer: weights are never loaded
    (load_format="dummy") and the KV cache stays small, while prompts may be 1000+ tokens."""
    config = model_config("qwen3").to_dict()
    config.pop("layer_types", None)
    config.update(
        architectures=["Qwen3ForCausalLM"], num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=MAX_MODEL_LEN,
    )
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / "config.json").write_text(json.dumps(config))
    build_tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def stub_model(tmp_path_factory) -> str:
    return write_stub_model(tmp_path_factory.mktemp("stub-model"))


class EngineDecodeBatch:
    """An LLMEngine with NUM_SEQS requests in decode whose runner skips the model.

    The runner still builds the step's inputs (build_decode) and returns fake tokens, so a step
    does all the engine's host work: scheduling, inputs, postprocess, per-request bookkeeping,
    incremental detokenization and the RequestOutputs.
    """

    def __init__(self, model_dir: str, block_size: int, seed: int = 0, final_only: bool = False):
        self.final_only = final_only  # generate()/bench path: no per-step outputs or detokenization
        self.llm = LLM(
            model_dir, load_format="dummy", dtype="float32", device="cpu", block_size=block_size,
            num_kv_blocks=kv_blocks_for(block_size), max_num_seqs=NUM_SEQS,
            max_num_batched_tokens=MAX_BATCHED_TOKENS, max_model_len=MAX_MODEL_LEN,
            compile_mode="blocking",  # the model never runs here: no background compile either
            # Set-up prefills all 256 prompts at once; capped mixed steps would stretch that over
            # thousands of steps in which the first ones decode to the end. The measured steps
            # are plain decode steps either way.
            long_prefill_token_threshold=0,
        )
        self.engine = self.llm.engine
        self.block_size = block_size
        self.vocab = self.engine.config.model_config.vocab_size
        self.rng = np.random.default_rng(seed)
        self.tokens = fake_tokens(self.rng, self.vocab)
        # This instance only: launch hands its fake tokens straight to collect.
        self.engine.runner.launch = self._run_without_model
        self.engine.runner.collect = lambda tokens: tokens
        # The CPU attention backend's per-step index of every cached token (about 2 ms here at
        # 256 sequences) is the model's work on a CPU, not the host's: a GPU backend prepares a
        # few views. Left out, so the figure is the host work a GPU step waits for.
        self.engine.runner.inputs.prepare_meta = lambda meta: meta
        self.reset()

    def _run_without_model(self, out):
        if out.is_prefill:
            return ModelRunnerOutput([7 if out.samples(i) else None for i in range(len(out.seqs))])
        self.engine.runner.inputs.build_decode(out)
        tokens = self.tokens[self.steps % len(self.tokens)]
        self.steps += 1
        return ModelRunnerOutput(tokens[: len(out.seqs)])

    def reset(self) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
        for prompt in random_prompts(self.rng, self.vocab):
            params = SamplingParams(temperature=0.0, max_tokens=MAX_MODEL_LEN - len(prompt), ignore_eos=True)
            self.engine.enqueue(self.engine.prepare(prompt, params, final_only=self.final_only))
        scheduler = self.engine.scheduler
        self.steps = 0
        while scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in scheduler.running):
            self.engine.step()
        for _ in range(WARM_STEPS):
            self.step()
        self.measured = 0

    def before_round(self) -> None:
        if self.measured >= LAP_STEPS:
            self.reset()
        self.measured += 1

    def step(self) -> None:
        outputs = self.engine.step()
        assert len(outputs) == (0 if self.final_only else NUM_SEQS)

    def describe(self) -> dict:
        lens = [len(s) for s in self.engine.scheduler.running]
        return {
            "num_seqs": NUM_SEQS,
            "block_size": self.block_size,
            "mean_seq_len": round(sum(lens) / len(lens)),
            "kv_blocks": self.engine.block_manager.num_blocks,
            "prefix_caching": True,
            "outputs": "final-only" if self.final_only else "streaming (every step, detokenized)",
        }


@pytest.mark.benchmark(group="host-step")
@pytest.mark.parametrize("final_only", [pytest.param(False, id="streaming"), pytest.param(True, id="final-only")])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_engine_step_without_model(benchmark, stub_model, block_size, final_only):
    """LLMEngine.step() with the model forward and sampler stubbed out: the whole host side.

    streaming: every request reports (and detokenizes) every step, as an app's streams do;
    final-only: requests report when they finish, as LLM.generate and fastgen bench run them.
    """
    batch = EngineDecodeBatch(stub_model, block_size, final_only=final_only)
    benchmark.extra_info.update(batch.describe())
    benchmark.pedantic(batch.step, setup=batch.before_round, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS)
