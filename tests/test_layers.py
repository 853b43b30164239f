"""The import map of docs/architecture.md, enforced: every module's imports (parsed with ``ast``,
relative ones resolved, those inside functions and ``TYPE_CHECKING`` blocks included) must follow
the layers, so a wrong-way import fails the suite rather than a review.

    gateway > loadgen > engines_adapters > scheduler > predictors

A package imports only itself and the packages below it. The simulated engine
(``engines_adapters.sim``) is an engine, not a library: outside it, only the named exceptions below
may import it, and only the simulator's oracle may read its private calibration.
"""
import ast
import sys
from pathlib import Path

import pytest

import gateway.cli
import predictors.cli_args

ROOT = Path(__file__).resolve().parents[1]

#: Our packages, highest first, and the packages each may import besides itself.
LAYERS = ("gateway", "loadgen", "engines_adapters", "scheduler", "predictors")
MAY_IMPORT = {pkg: frozenset(LAYERS[i + 1:]) for i, pkg in enumerate(LAYERS)}

SIM = "engines_adapters.sim"
#: The sim engine's private calibration, beyond its public deployment: how it times a step.
CALIBRATION_MODULES = ("engines_adapters.sim.timing",)
#: ``Profile.efficiency``: the calibration numbers themselves (profiles.json).
CALIBRATION_ATTRIBUTE = "efficiency"

#: Who outside engines_adapters/sim may import which of its modules, and why (docs/architecture.md).
SIM_EXCEPTIONS: dict[str, tuple[str, ...]] = {
    # the embedded cluster: starts sim engines as subprocesses, with a profile the config names
    "gateway/embedded.py": (f"{SIM}.profiles",),
    "gateway/config.py": (f"{SIM}.profiles",),  # checks the [embedded] profile name when loading
    # the virtual-time simulator drives the sim engine's EngineModel in-process
    "loadgen/simulate/": (SIM,),
}
#: ... and of those, the readers of the private calibration: the simulator's oracle predictors
#: (the upper bound a predictor could reach) and the offline attainment bound (what any policy could
#: reach; it never serves a decision).
CALIBRATION_READERS = ("loadgen/simulate/oracle.py", "loadgen/simulate/bound.py")


def _module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, rel: Path) -> set[str]:
    """Absolute names a module at ``rel`` (relative to the repo root) imports: ``import a.b`` gives
    a.b; ``from a import b`` gives a and a.b (b may be a module); relative imports are resolved."""
    package = rel.parent.parts  # what a relative import is relative to (for __init__.py too)
    names: set[str] = set()
    for node in ast.walk(ast.parse(source, str(rel))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[:len(package) - (node.level - 1)])
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names if a.name != "*")
    return names


def calibration_reads(source: str, rel: Path) -> list[int]:
    """Lines where a module reads an ``.efficiency`` attribute (a sim profile's calibration)."""
    return [node.lineno for node in ast.walk(ast.parse(source, str(rel)))
            if isinstance(node, ast.Attribute) and node.attr == CALIBRATION_ATTRIBUTE]


def _under(name: str, module: str) -> bool:
    return name == module or name.startswith(module + ".")


def _exception_for(rel: str) -> tuple[str, ...]:
    """The sim modules ``rel`` may import: the most specific entry of SIM_EXCEPTIONS that covers it."""
    keys = [k for k in SIM_EXCEPTIONS if rel == k or (k.endswith("/") and rel.startswith(k))]
    return SIM_EXCEPTIONS[max(keys, key=len)] if keys else ()


def violations(source: str, rel: Path) -> list[str]:
    """Every import (or calibration read) of the module at ``rel`` that breaks the map."""
    pkg, path = rel.parts[0], rel.as_posix()
    in_sim = path.startswith("engines_adapters/sim/")
    reads_calibration = in_sim or path in CALIBRATION_READERS
    out = []
    for name in sorted(imports_of(source, rel)):
        top = name.split(".")[0]
        if top in LAYERS and top != pkg and top not in MAY_IMPORT[pkg]:
            below = ", ".join(sorted(MAY_IMPORT[pkg])) or "nothing of ours"
            out.append(f"{path}: {name} ({pkg} may import only itself and {below})")
        elif _under(name, SIM) and not in_sim:
            allowed = _exception_for(path)
            if not any(_under(name, m) for m in allowed):
                out.append(f"{path}: {name} (the sim engine; allowed here: {', '.join(allowed) or 'nothing'})")
            elif not reads_calibration and any(_under(name, m) for m in CALIBRATION_MODULES):
                out.append(f"{path}: {name} (the sim engine's private calibration)")
    if not reads_calibration:
        out += [f"{path}:{line}: .{CALIBRATION_ATTRIBUTE} (the sim engine's private calibration)"
                for line in calibration_reads(source, rel)]
    return out


def _modules() -> list[Path]:
    return [p.relative_to(ROOT) for pkg in LAYERS for p in sorted((ROOT / pkg).rglob("*.py"))]


def test_every_package_has_a_place_in_the_map():
    packages = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "bench"}
    assert packages == set(LAYERS)


def test_every_module_follows_the_import_map():
    modules = _modules()
    assert len(modules) > 50  # the walk found the code
    offenders = [v for rel in modules for v in violations((ROOT / rel).read_text(), rel)]
    assert offenders == []


def test_every_named_exception_is_still_needed():
    """An exception nobody uses any more is a hole in the map: remove it."""
    used = {k: False for k in SIM_EXCEPTIONS}
    for rel in _modules():
        path = rel.as_posix()
        names = imports_of((ROOT / rel).read_text(), rel)
        for k in SIM_EXCEPTIONS:
            if (path == k or (k.endswith("/") and path.startswith(k))) and any(_under(n, SIM) for n in names):
                used[k] = True
    assert [k for k, u in used.items() if not u] == []


@pytest.mark.parametrize("path, source", [
    ("scheduler/x.py", "from engines_adapters.kv_wire import BlockStored"),
    ("scheduler/x.py", "def f():\n    import gateway.config"),  # lazy imports count too
    ("predictors/x.py", "from scheduler import Scheduler"),
    ("predictors/x.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import loadgen"),
    ("engines_adapters/x.py", "from loadgen.workload import Request"),
    ("engines_adapters/x.py", "from engines_adapters.sim.model import EngineModel"),
    ("engines_adapters/drivers/x.py", "from ..sim import model"),  # relative, resolved
    ("engines_adapters/x.py", "from engines_adapters import sim"),
    ("loadgen/x.py", "from gateway.cli import main"),
    ("loadgen/runner2.py", "from engines_adapters.sim.profiles import load_profile"),  # not the simulator
    ("loadgen/simulate/cluster2.py", "from engines_adapters.sim.timing import StepTimer"),  # not the oracle
    ("loadgen/simulate/cluster2.py", "def f(p):\n    return p.efficiency['mfu']"),
    ("gateway/proxy2.py", "from engines_adapters.sim.model import EngineModel"),
    ("gateway/embedded.py", "from engines_adapters.sim.timing import StepTimer"),
])
def test_a_wrong_way_import_is_caught(path, source):
    assert violations(source, Path(path)) != []


@pytest.mark.parametrize("path, source", [
    ("gateway/x.py", "import loadgen.cli, engines_adapters.drivers, scheduler, predictors.types"),
    ("loadgen/x.py", "from engines_adapters.tokenizer import BuiltinTokenizer\nfrom .workload import Request"),
    ("engines_adapters/sim/model.py", "from scheduler.hashing import block_hashes\nfrom .timing import StepTimer"),
    ("loadgen/simulate/oracle.py", "from engines_adapters.sim.timing import StepTimer"),
    ("scheduler/policies/x.py", "from ..cost import DecisionContext\nfrom predictors.types import Role"),
])
def test_a_right_way_import_passes(path, source):
    assert violations(source, Path(path)) == []


def test_cli_args_is_standard_library_only():
    rel = Path("predictors/cli_args.py")
    top = {name.split(".")[0] for name in imports_of((ROOT / rel).read_text(), rel)}
    assert top - {"__future__"} <= set(sys.stdlib_module_names)


def test_dispatcher_catches_the_class_subcommands_raise():
    assert gateway.cli.CLIError is predictors.cli_args.CLIError
