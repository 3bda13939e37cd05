"""Flag converters: the text a user types, parsed and checked."""

from __future__ import annotations

import argparse

import pytest

from fastgen.cli.arg_types import byte_size


@pytest.mark.parametrize("text, expected", [("1024", 1024), ("4GiB", 4 << 30), ("512MiB", 512 << 20),
                                            ("2GB", 2 * 10**9), ("1.5k", 1500), ("16 mib", 16 << 20)])
def test_byte_sizes_parse(text, expected):
    assert byte_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "-4GiB", "4 XB", "0"])
def test_bad_byte_sizes_are_rejected(text):
    with pytest.raises(argparse.ArgumentTypeError):
        byte_size(text)
