"""A batch of requests kept in decode for step benchmarks: each round is one real decode step,
and the batch is replaced (untimed) every `lap_steps` rounds so lengths stay in a band."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fastgen import LLM, SamplingParams


class DecodingRequests:
    """`batch` requests with prompts of `prompt_lens` = (low, high) tokens, past their prefill.

    sync: called after every step (torch.cuda.synchronize on a GPU, so a step is timed whole).
    """

    def __init__(self, llm: LLM, batch: int, prompt_lens: tuple[int, int], warm_steps: int, lap_steps: int,
                 seed: int = 0, sync: Callable[[], None] = lambda: None):
        self.engine = llm.engine
        self.batch = batch
        self.prompt_lens = prompt_lens
        self.warm_steps = warm_steps
        self.lap_steps = lap_steps
        self.sync = sync
        self.rng = np.random.default_rng(seed)
        self.vocab = self.engine.config.model_config.vocab_size
        self.reset()

    def reset(self) -> None:
        engine = self.engine
        for request_id in list(engine.requests):
            engine.abort(request_id)
        params = SamplingParams(temperature=0.0, max_tokens=self.lap_steps + self.warm_steps + 16, ignore_eos=True)
        for n in self.rng.integers(*self.prompt_lens, self.batch):
            engine.add_request(self.rng.integers(1, self.vocab, n).tolist(), params)
        scheduler = engine.scheduler
        while scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in scheduler.running):
            engine.step()
        for _ in range(self.warm_steps):
            engine.step()
        self.sync()
        self.measured = 0

    def before_round(self) -> None:
        """pedantic() setup: replace the batch once a lap is over."""
        if self.measured >= self.lap_steps:
            self.reset()
        self.measured += 1

    def step(self) -> int:
        """One engine step; returns how many outputs it produced."""
        outputs = self.engine.step()
        self.sync()
        return len(outputs)
