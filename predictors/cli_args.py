"""Command-line argument helpers every ``conductor`` subcommand shares (standard library only).

They live in the lowest layer so the sim engine, the load generator and the gateway can all build
their parsers without importing the gateway: :class:`CLIError` in particular must be one class,
raised by a subcommand and caught by the dispatcher in ``gateway/cli.py``.
"""
from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class CLIError(Exception):
    """A user error: printed as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage dump) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(2)


def positive_float(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def positive_int(text: str) -> int:
    v = int(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return v


def non_negative_int(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def non_negative_float(text: str) -> float:
    v = float(text)
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def port(text: str) -> int:
    v = int(text)
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {text}")
    return v


def key_value(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` (e.g. ``--policy-param``): the pair, stripped."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()
