"""What a grammar library must offer the engine: compile a spec once, then a matcher per
sequence that accepts tokens and fills the mask of the tokens allowed next.

Masks are int32 words, bit t % 32 of word t // 32 for token t (xgrammar's layout, which the
sampler's `token_bitmask` unpacks). Another library joins by implementing these three.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from fastgen.structured_outputs_params import StructuredOutputsParams

if TYPE_CHECKING:
    import torch


class GrammarMatcher(Protocol):
    """One sequence's place in its grammar."""

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False (and no change) when the grammar does not allow it."""

    def fill_bitmask(self, bitmask: "torch.Tensor", row: int) -> None:
        """Write the tokens allowed next into row `row` of an int32 CPU bitmask."""

    def is_terminated(self) -> bool:
        """Whether the grammar is complete and its end token was accepted."""


class CompiledGrammar(Protocol):
    def matcher(self) -> GrammarMatcher: ...


class GrammarBackend(Protocol):
    """A grammar library bound to one tokenizer and vocabulary."""

    name: str

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """Compile a spec (seconds at most); ValueError naming the field and what is wrong."""

    def allocate_bitmask(self, rows: int) -> "torch.Tensor":
        """An int32 CPU tensor [rows, ceil(vocab / 32)] for `fill_bitmask`."""
