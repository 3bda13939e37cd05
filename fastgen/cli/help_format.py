"""How every fastgen subcommand prints --help: defaults shown, examples kept as written."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Appends "(default: X)" to a flag's help when it has a meaningful default.

    argparse's ArgumentDefaultsHelpFormatter also prints "(default: None)" and "(default:
    False)" for optional values and switches, which says nothing; those are left out here.
    Descriptions and epilogs keep their line breaks (the examples are laid out by hand).
    """

    def __init__(self, prog: str):
        super().__init__(prog, max_help_position=36, width=100)

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        default = action.default
        if (
            "%(default)" in help_text
            or default is None
            or default is argparse.SUPPRESS
            or isinstance(default, bool)
            or not action.option_strings
        ):
            return help_text
        return f"{help_text} (default: %(default)s)"
