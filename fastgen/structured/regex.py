"""A `regex` spec read as `re.fullmatch(regex, output, flags=re.ASCII)` reads it, for xgrammar.

xgrammar's regex compiler reads some syntax otherwise than Python: its `.` matches a newline too,
it ignores `^` and `$` wherever they stand (`a^b` admitted "ab", which `re.fullmatch` rejects),
it takes `\\A` / `\\Z` for letters, and it refuses a class that opens with a literal `]`.
`full_match_regex` rewrites `.` outside a character class as `[^\\n]` and such a `]` as `\\]`,
drops `\\A` / `\\Z` / `\\z` at the pattern's two ends, where they change nothing (the whole output
must match anyway), and refuses any anchor elsewhere, word boundaries included. Its `\\d`, `\\w`
and `\\s` are ASCII's, as under `re.ASCII`. Syntax xgrammar lacks (lookarounds, inline flags,
`x{,2}`) it refuses itself.
"""

from __future__ import annotations

_ANCHOR_ESCAPES = "AZzbB"


def full_match_regex(pattern: str) -> str:
    """`pattern` for xgrammar's regex compiler, admitting exactly what re.fullmatch admits under
    re.ASCII; ValueError naming the position of an anchor that is not at either end."""
    out: list[str] = []
    i, in_class, class_start = 0, False, 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            escaped = pattern[i + 1:i + 2]
            if not in_class and escaped and escaped in _ANCHOR_ESCAPES:
                at_an_end = escaped == "A" and i == 0 or escaped in "Zz" and i + 2 == len(pattern)
                if not at_an_end:
                    raise ValueError(f"structured_outputs.regex: \\{escaped} at position {i} is not supported: only "
                                     "\\A at the very start or \\Z at the very end, as the whole output must match "
                                     "the regex anyway")
                i += 2
                continue
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            if ch == "]":
                if i > class_start + (pattern[class_start:class_start + 1] == "^"):
                    in_class = False
                else:  # first in the class (after an optional "^"): Python's literal "]", escaped for xgrammar
                    ch = "\\]"
        elif ch == "[":
            in_class, class_start = True, i + 1
        elif ch == ".":
            ch = "[^\\n]"
        elif ch == "^" and i != 0 or ch == "$" and i != len(pattern) - 1:
            raise ValueError(f"structured_outputs.regex: the anchor {ch!r} at position {i} is not supported: only "
                             "at the very start (^) or end ($), as the whole output must match the regex anyway")
        out.append(ch)
        i += 1
    return "".join(out)
