"""`fastgen generate`: complete one or more prompts and print the text."""

from __future__ import annotations

import argparse
import sys

from fastgen.cli import arg_types, engine_args

DESCRIPTION = """\
Complete prompts with a model and print the completions (one prompt: just its text). Without
--model the default model, SmolLM2-135M-Instruct, is used (converted once on first use).
Decode runs eagerly unless --no-enforce-eager: a one-shot command would spend longer compiling
the CPU decode step (minutes the first time; loading it once saved takes a few seconds) or
capturing CUDA graphs than it saves."""

EPILOG = """\
examples:
  fastgen generate "The capital of France is"
  fastgen generate --chat "Write a haiku about the sea." --temperature 0.7 --top-p 0.9 --stream
  fastgen generate --n 3 --temperature 1 --presence-penalty 0.5 "A name for a cat:"
  fastgen generate --model ./Qwen3-0.6B --max-tokens 64 "Once upon a time" "def fib(n):"
  fastgen generate --chat --json-schema person.json "Describe a fictional person as JSON."
  fastgen generate --chat --choice yes --choice no "Is Paris in France?"
  echo "Tell me a joke." | fastgen generate --chat -"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text; '-' reads it from stdin")
    group = parser.add_argument_group("generation")
    group.add_argument("--chat", action="store_true",
                       help="wrap the prompt as a user message in the model's chat template")
    group.add_argument("--system", metavar="TEXT", default=None, help="system message (with --chat)")
    group.add_argument("--max-tokens", metavar="N", type=arg_types.positive_int, default=128, help="most tokens to generate")
    group.add_argument("--temperature", metavar="T", type=arg_types.non_negative_float, default=0.0,
                       help="0 is greedy (deterministic); higher samples more freely")
    group.add_argument("--top-p", metavar="P", type=arg_types.fraction, default=1.0,
                       help="sample from the smallest set of tokens with this much probability")
    group.add_argument("--top-k", metavar="K", type=arg_types.top_k, default=-1,
                       help="sample from the k most likely tokens; -1: all")
    group.add_argument("--stop", action="append", metavar="TEXT", default=None,
                       help="end the completion before this text (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    group.add_argument("--n", metavar="N", type=arg_types.positive_int, default=1,
                       help="completions of each prompt, printed one after another")
    group.add_argument("--presence-penalty", metavar="P", type=float, default=0.0,
                       help="subtract P from the logit of every token already generated, in [-2, 2]")
    group.add_argument("--frequency-penalty", metavar="F", type=float, default=0.0,
                       help="subtract F per time a token was generated, in [-2, 2]")
    group.add_argument("--repetition-penalty", metavar="R", type=float, default=1.0,
                       help="divide positive (multiply negative) logits of prompt and generated tokens, in (0, 2]")
    group.add_argument("--min-tokens", metavar="N", type=arg_types.non_negative_int, default=0,
                       help="generate at least N tokens before end-of-sequence or a stop")
    group.add_argument("--min-p", metavar="P", type=float, default=0.0,
                       help="drop tokens below P times the most likely one's probability, in [0, 1]")
    group.add_argument("--stream", action="store_true", help="print tokens as they are generated (one prompt)")
    shape = parser.add_argument_group("output shape (structured outputs; one of)").add_mutually_exclusive_group()
    shape.add_argument("--json-schema", metavar="FILE", type=arg_types.existing_file, default=None,
                       help="the output is JSON valid against the JSON schema in FILE")
    shape.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    shape.add_argument("--regex", metavar="REGEX", default=None, help="the output matches this regular expression")
    shape.add_argument("--choice", action="append", metavar="TEXT", default=None,
                       help="the output is exactly one of these texts (repeatable)")
    shape.add_argument("--grammar", metavar="FILE", type=arg_types.existing_file, default=None,
                       help="the output follows the EBNF grammar in FILE (xgrammar/GBNF syntax, rule `root`)")
    group.add_argument("--stats", action="store_true",
                       help="print token counts, TTFT and decode speed to stderr")
    engine_args.add_engine_args(parser, dummy_weights=False,
                                max_model_len_default="the model's max_position_embeddings (n_positions for GPT-2)")
    parser.set_defaults(enforce_eager=True)


def chat_prompt(tokenizer, text: str, system: str | None) -> list[int]:
    """Token ids of `text` as a user turn (after an optional system turn), ready for the
    assistant's reply. Raises ValueError when the tokenizer has no chat template."""
    from fastgen.engine.prompts import chat_token_ids

    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("--chat: the model's tokenizer has no chat template; drop --chat to send raw text")
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": text})
    return chat_token_ids(tokenizer, messages, add_generation_prompt=True)


def run(args: argparse.Namespace) -> int:
    parser = args.parser
    if args.stream and len(args.prompts) > 1:
        parser.error(f"argument --stream: streams one prompt, got {len(args.prompts)}")
    if args.stream and args.n > 1:
        parser.error(f"argument --stream: streams one completion, got --n {args.n}")
    if args.system is not None and not args.chat:
        parser.error("argument --system: needs --chat")
    if args.prompts.count("-") > 1:
        parser.error("argument PROMPT: '-' (stdin) can be given once")
    texts = [sys.stdin.read() if p == "-" else p for p in args.prompts]
    choice = engine_args.resolve_model(args, parser, need_tokenizer=True)

    from fastgen.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos, stop=args.stop or [], n=args.n,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty, min_tokens=args.min_tokens, min_p=args.min_p,
        structured_outputs=_structured_outputs(args),
    )
    llm = engine_args.build_llm(choice, args, need_tokenizer=True)
    prompts = [chat_prompt(llm.tokenizer, t, args.system) for t in texts] if args.chat else texts

    if args.stream:
        final = None
        for output in llm.stream(prompts[0], params):
            sys.stdout.write(output.new_text)
            sys.stdout.flush()
            final = output
        sys.stdout.write("\n")
        outputs = [final]
    else:
        outputs = llm.generate(prompts, params)
        for i, output in enumerate(outputs):
            if len(outputs) > 1:
                print(f"=== {i + 1}/{len(outputs)} ===")
            for completion in output.outputs:
                if args.n > 1:
                    print(f"--- completion {completion.index + 1}/{args.n} ---")
                print(completion.text)
    if args.stats:
        for output in outputs:
            print(_stats_line(output), file=sys.stderr)
    return 0


def _structured_outputs(args: argparse.Namespace) -> dict | None:
    """The output-shape flag as StructuredOutputsParams fields (None: free text); ValueError
    (exit 2) for a schema file that is not JSON."""
    if args.json_schema is not None:
        return {"json": args.json_schema.read_text()}
    if args.grammar is not None:
        return {"grammar": args.grammar.read_text()}
    if args.json_object:
        return {"json_object": True}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice is not None:
        return {"choice": args.choice}
    return None


def _stats_line(output) -> str:
    m = output.metrics
    line = (f"[{output.request_id}] {len(output.prompt_token_ids)} prompt + {len(output.token_ids)} generated "
            f"tokens, finish {output.finish_reason}")
    if m.time_to_first_token is not None:
        line += f", TTFT {m.time_to_first_token * 1000:.1f} ms"
    if m.time_per_output_token:
        line += f", {1.0 / m.time_per_output_token:.1f} tok/s decode"
    return line
