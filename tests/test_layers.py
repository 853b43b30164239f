"""Import direction: nothing below the gateway imports it (the gateway sits on top of every layer),
and the CLI argument helpers every subcommand shares are standard library only."""
import ast
import sys
from pathlib import Path

import gateway.cli
import predictors.cli_args

ROOT = Path(__file__).resolve().parents[1]
BELOW_GATEWAY = ("loadgen", "engines_adapters", "scheduler", "predictors")


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_nothing_below_the_gateway_imports_it():
    offenders = [f"{p.relative_to(ROOT)}: {name}"
                 for pkg in BELOW_GATEWAY for p in sorted((ROOT / pkg).rglob("*.py"))
                 for name in _imports(p) if name == "gateway" or name.startswith("gateway.")]
    assert offenders == []


def test_cli_args_is_standard_library_only():
    top = {name.split(".")[0] for name in _imports(ROOT / "predictors" / "cli_args.py")}
    assert top - {"__future__"} <= set(sys.stdlib_module_names)


def test_dispatcher_catches_the_class_subcommands_raise():
    assert gateway.cli.CLIError is predictors.cli_args.CLIError
