"""The ``conductor`` command: dispatches each subcommand to the module that owns it.

Each subcommand module exposes ``main(argv: list[str]) -> int`` and builds its options with
:class:`predictors.cli_args.Parser`, so every command answers ``--help`` and reports bad arguments
in one line; a :class:`~predictors.cli_args.CLIError` it raises is reported here, exit code 2.
"""
from __future__ import annotations

import importlib
import sys

from predictors.cli_args import CLIError

# subcommand -> (module, one-line summary)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("gateway.serve", "serve the OpenAI-compatible gateway (embedded simulated cluster by default)"),
    "sim-engine": ("engines_adapters.sim.server", "run one simulated vLLM- or SGLang-compatible engine"),
    "sim-store": ("engines_adapters.store.server", "run one modelled Mooncake KV store (master HTTP + data path)"),
    "loadgen": ("loadgen.cli", "replay a trace against an OpenAI-compatible endpoint and draw goodput curves"),
    "simulate": ("loadgen.simulate", "run whole traces through the scheduler in a discrete-event simulation"),
    "calibrate": ("predictors.calibrate", "fit the predictors from telemetry"),
}


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
    # CLIError comes from predictors.cli_args, so it is one class even when this file runs as __main__
    sys.exit(main())
