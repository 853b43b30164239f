"""The ``conductor`` command: dispatches each subcommand to the module that owns it.

Each subcommand module exposes ``main(argv: list[str]) -> int`` and builds its options with
:class:`Parser`, so every command answers ``--help`` and reports bad arguments in one line.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line summary)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("gateway.serve", "serve the OpenAI-compatible gateway (embedded simulated cluster by default)"),
    "sim-engine": ("engines_adapters.sim.server", "run one simulated vLLM-compatible engine"),
    "loadgen": ("loadgen.cli", "replay a trace against an OpenAI-compatible endpoint and draw goodput curves"),
    "simulate": ("loadgen.simulate", "run whole traces through the scheduler in a discrete-event simulation"),
    "calibrate": ("predictors.calibrate", "fit the predictors from telemetry"),
}


class CLIError(Exception):
    """A user error: printed as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage dump) and exit code 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
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


def port(text: str) -> int:
    v = int(text)
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {text}")
    return v


def _usage() -> str:
    lines = ["usage: conductor COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<11} {summary}" for name, (_, summary) in COMMANDS.items()]
    lines += ["", "Run 'conductor COMMAND --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        sys.stderr.write(f"conductor: error: unknown command {name!r}; expected one of {', '.join(COMMANDS)}\n")
        return 2
    module_name = COMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        sys.stderr.write(f"conductor {name}: not built yet\n")
        return 2
    try:
        return int(module.main(rest) or 0)
    except CLIError as e:
        sys.stderr.write(f"conductor {name}: error: {e}\n")
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    # run the imported module's main, so subcommands raise the same CLIError class it catches
    from gateway.cli import main as _main

    sys.exit(_main())
