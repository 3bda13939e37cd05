"""The `speculative_config` engine setting (vLLM's names), checked into a plain dict."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from fastgen.checks import integer
from fastgen.quantization.formats import METHODS as DRAFT_QUANTIZATION

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_DISABLE_BY_BATCH_SIZE = None


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: "ngram" (prompt lookup) or "draft_model" (a smaller model of the same vocabulary
    proposes its greedy continuation: `model`, its folder or hub id, and `quantization`, its own
    weight-only quantization, e.g. the target's own model in int4). num_speculative_tokens: most draft tokens a sequence
    proposes in one step (k; a verified step computes k + 1 positions of it). prompt_lookup_max /
    prompt_lookup_min: the longest and shortest trailing n-gram searched for (the longest that
    occurs earlier wins; drafts after a match of one token are weighed apart, see
    `fastgen.speculative.drafts`). disable_by_batch_size: no sequence drafts in a step that decodes this
    many sequences or more (vLLM's name): each drafted position costs a row of every product and
    of the LM head, which a large batch pays in compute where one sequence's step only waits for
    the weights (so each sequence's draft is already cut to what its acceptance pays for at the
    step's batch size: `fastgen.speculative.drafts`); None (default): no cap beyond that."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE
    model: str | None = None
    quantization: str | None = None

    @classmethod
    def from_dict(cls, value: dict) -> "SpeculativeConfig":
        return cls(**value)


def check_speculative_config(name: str, value: object) -> dict:
    """The setting with its defaults filled in, or ValueError naming the key, the value and the
    limit."""
    if isinstance(value, SpeculativeConfig):
        value = asdict(value)
    if not isinstance(value, dict):
        raise ValueError(f"{name}={value!r} must be a dict such as {{'method': 'ngram', 'num_speculative_tokens': 4}}")
    known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size",
             "model", "quantization"}
    if unknown := sorted(set(value) - known):
        raise ValueError(f"{name} has unknown keys {unknown}; known: {sorted(known)}")
    method = value.get("method", "ngram")
    if method not in METHODS:
        raise ValueError(f"{name}['method']={method!r} is not one of {list(METHODS)}")
    model, quantization = value.get("model"), value.get("quantization")
    if method == "draft_model":
        if not isinstance(model, str) or not model:
            raise ValueError(f"{name}['model']={model!r} must name the draft model (a folder or hub id) for "
                             "method 'draft_model'")
        if quantization is not None and quantization not in DRAFT_QUANTIZATION:
            raise ValueError(f"{name}['quantization']={quantization!r} is not one of {list(DRAFT_QUANTIZATION)} "
                             "or None")
    else:
        for key in ("model", "quantization"):
            if value.get(key) is not None:
                raise ValueError(f"{name}[{key!r}]={value[key]!r} is for method 'draft_model', not {method!r}")
    k = integer(f"{name}['num_speculative_tokens']", value.get("num_speculative_tokens", 4), minimum=1,
                below=MAX_SPECULATIVE_TOKENS + 1, below_text=str(MAX_SPECULATIVE_TOKENS + 1))
    high = integer(f"{name}['prompt_lookup_max']", value.get("prompt_lookup_max", 4), minimum=1, below=65,
                   below_text="65")
    low = integer(f"{name}['prompt_lookup_min']", value.get("prompt_lookup_min", 1), minimum=1)
    if low > high:
        raise ValueError(f"{name}['prompt_lookup_min']={low} must be <= prompt_lookup_max={high}")
    disable = value.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
    if disable is not None:
        disable = integer(f"{name}['disable_by_batch_size']", disable, minimum=2)
    return asdict(SpeculativeConfig(method, k, high, low, disable, model, quantization))
