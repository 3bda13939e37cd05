"""Per-request sampling settings, validated where the user hands them in."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fastgen.checks import FLOAT32_MAX, boolean, integer, keep_signature, known_fields, real
from fastgen.structured_outputs_params import StructuredOutputsParams

LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
# Entries a logit_bias may hold: the sampler adds them every step, so one request's huge map would
# slow every request's steps.
LOGIT_BIAS_MAX_ENTRIES = 1024

# Temperatures below this are greedy: dividing logits by a smaller one overflows float32 (and
# argmax is what such a temperature means anyway).
MIN_SAMPLING_TEMPERATURE = 1e-5
SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes seeds in [0, 2**64)


@keep_signature
@dataclass
class SamplingParams:
    """How one request is decoded.

    temperature: 0 (or below 1e-5) means greedy; otherwise logits are divided by it before
        sampling. At most 3.4e38, the largest float32 (the sampler's arithmetic).
    top_k: keep the k most likely tokens; -1 keeps all, and so does any k >= the vocabulary size
        (it is clamped to the vocabulary).
    top_p: keep the smallest set of tokens whose probability mass reaches top_p (1.0 keeps all);
        the most likely token always survives, however small top_p is.
    max_tokens: the most tokens generated for this request (prompt + max_tokens <= max_model_len).
    ignore_eos: keep generating past the model's end-of-sequence token.
    seed: makes this request's sampling reproducible, whatever else is in the batch.
    stop_token_ids: extra token ids that end the request (the token is kept in the output).
    stop: strings that end the request; the matched string is cut from the text.

    vLLM's further fields, with vLLM's meanings:
    n: completions of the prompt, sampled independently (one prefill; see RequestOutput.outputs).
        With a seed, completion i samples with seed + i.
    logprobs: per generated token, return the log-probabilities of the sampled token and of the
        `logprobs` most likely tokens (None: none). From the model's raw log-softmax, before
        temperature, penalties and filtering. At most the engine's max_logprobs.
    prompt_logprobs: the same for every prompt token (the first has none). Such a request
        computes its whole prompt (it does not read the prefix cache).
    presence_penalty: subtracted from the logit of every token already generated, in [-2, 2].
    frequency_penalty: subtracted once per time a token was generated, in [-2, 2].
    repetition_penalty: divides the positive logits (multiplies the negative ones) of every token
        in the prompt or generated so far, in (0, 2]; 1 is off (transformers' and vLLM's rule).
    min_tokens: generate at least this many tokens: until then end-of-sequence and stop_token_ids
        cannot be sampled and stop strings are not matched. At most max_tokens.
    min_p: drop tokens whose probability is below min_p times the most likely one's (after
        temperature), in [0, 1]; 0 is off.
    logit_bias: token id -> a number in [-100, 100] added to that token's logit before anything
        else (OpenAI's field; -100 all but bans a token, 100 all but forces it); at most 1024 entries.
    structured_outputs: what the output must match (a `StructuredOutputsParams`, or a dict of its
        fields): a JSON schema, any JSON object, a regex, a choice of strings or a grammar.
        Tokens that would break it are masked before sampling.
    prediction: the output the caller expects, or most of it (OpenAI's predicted outputs): text,
        or token ids. With speculative decoding on (the engine's speculative_config), drafts are
        looked up in it first, so an output that repeats it decodes several tokens a step; it never
        changes which tokens are generated. Ignored without speculative decoding. At most
        PREDICTION_MAX_LENGTH characters or tokens.

    A request keeps its own validated copy (`validated_copy`): changing this object after the
    request was added changes nothing in it.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 16
    ignore_eos: bool = False
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    prediction: str | list[int] | None = None

    def __new__(cls, *args, **kwargs):
        known_fields(cls, kwargs, "SamplingParams")  # a misspelt or unsupported field is a ValueError too
        return super().__new__(cls)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    def validated_copy(self) -> "SamplingParams":
        """A new, validated SamplingParams with this one's values (lists copied, numbers as
        plain int / float): what a request keeps for itself."""
        return SamplingParams(**{f.name: getattr(self, f.name) for f in dataclasses.fields(SamplingParams)})

    def validate(self) -> None:
        """Check every field and normalise it (plain Python types; the two lists copied). Raises
        ValueError naming the field, the value and the limit."""
        self.temperature = real("temperature", self.temperature, "a finite number in [0, 3.4e38] (float32)",
                                low=0.0, high=FLOAT32_MAX)
        try:
            top_k = integer("top_k", self.top_k, minimum=-1)
        except ValueError:
            top_k = 0
        if top_k == 0:
            raise ValueError(f"top_k={self.top_k!r} must be -1 (disabled) or an integer >= 1")
        self.top_k = top_k
        self.top_p = real("top_p", self.top_p, "in (0, 1]", low=0.0, high=1.0, low_open=True)
        self.max_tokens = integer("max_tokens", self.max_tokens, minimum=1)
        self.ignore_eos = boolean("ignore_eos", self.ignore_eos)
        if self.seed is not None:
            self.seed = integer("seed", self.seed, minimum=0, below=SEED_LIMIT, below_text="2**64")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):
            if getattr(self, name) is None:  # vLLM's default for both
                setattr(self, name, [])
            value = getattr(self, name)
            if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
                raise ValueError(f"{name}={value!r} must be a list")
        self.stop_token_ids = [integer(f"stop_token_ids[{i}]", t, minimum=0)
                               for i, t in enumerate(self.stop_token_ids)]
        self.stop = list(self.stop)
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise ValueError(f"stop must hold non-empty strings, got {text!r}")
        self._validate_vllm_fields()

    # ---- vLLM's further fields ---------------------------------------------------------------
    @property
    def has_penalties(self) -> bool:
        """Whether any of the three penalties is on (the sampler then keeps this request's token counts)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def _validate_vllm_fields(self) -> None:
        self.n = integer("n", self.n, minimum=1)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, integer(name, getattr(self, name), minimum=0))
        self.presence_penalty = real("presence_penalty", self.presence_penalty, "in [-2, 2]", low=-2.0, high=2.0)
        self.frequency_penalty = real("frequency_penalty", self.frequency_penalty, "in [-2, 2]", low=-2.0, high=2.0)
        self.repetition_penalty = real("repetition_penalty", self.repetition_penalty, "in (0, 2]", low=0.0, high=2.0,
                                       low_open=True)
        self.min_p = real("min_p", self.min_p, "in [0, 1]", low=0.0, high=1.0)
        self.min_tokens = integer("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias={self.logit_bias!r} must be a dict of token id -> bias")
            if len(self.logit_bias) > LOGIT_BIAS_MAX_ENTRIES:
                raise ValueError(f"logit_bias holds {len(self.logit_bias)} entries, more than {LOGIT_BIAS_MAX_ENTRIES}")
            self.logit_bias = {
                integer("logit_bias key", token, minimum=0): real(
                    f"logit_bias[{token}]", bias, f"in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]",
                    low=-LOGIT_BIAS_LIMIT, high=LOGIT_BIAS_LIMIT)
                for token, bias in self.logit_bias.items()} or None
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if self.prediction is not None:
            self.prediction = _prediction(self.prediction)

    def check_logprobs_limit(self, limit: int) -> None:
        """ValueError unless logprobs and prompt_logprobs are at most `limit` (the engine's)."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > limit:
                raise ValueError(f"{name}={value} must be <= {limit} (the engine's max_logprobs, capped at the "
                                 f"vocabulary size)")


PREDICTION_MAX_LENGTH = 1 << 16  # drafts are looked up in it every step


def _prediction(value: object) -> str | list[int]:
    """A predicted output: text, or a list of token ids (each >= 0)."""
    if isinstance(value, str):
        if len(value) > PREDICTION_MAX_LENGTH:
            raise ValueError(f"prediction holds {len(value)} characters, more than {PREDICTION_MAX_LENGTH}")
        return value
    if isinstance(value, (bytes, dict)) or not hasattr(value, "__iter__"):
        raise ValueError(f"prediction={value!r} must be a string or a list of token ids")
    tokens = list(value)
    if len(tokens) > PREDICTION_MAX_LENGTH:
        raise ValueError(f"prediction holds {len(tokens)} tokens, more than {PREDICTION_MAX_LENGTH}")
    return [integer(f"prediction[{i}]", t, minimum=0) for i, t in enumerate(tokens)]
