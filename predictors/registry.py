"""Predictor bundles by name, so a config file or a command line can choose them.

``analytic`` is the roofline over public facts (always available); later kinds (learned models
from ``conductor calibrate``, the simulator's oracle) register themselves the same way. A factory
takes keyword arguments and returns a :class:`predictors.base.Predictors`. Built-in factories are
named by import path and loaded on first use, so this module imports nothing heavy.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

from predictors.base import Predictors

Factory = Callable[..., Predictors]

_BUILTIN: dict[str, str] = {"analytic": "predictors.analytic:analytic_predictors",
                            "learned": "predictors.learned:learned_predictors"}
_FACTORIES: dict[str, Factory] = {}


def register_predictors(name: str, factory: Factory) -> None:
    """Make ``make_predictors(name, ...)`` build with ``factory``; ValueError if the name is taken."""
    if name in _FACTORIES or name in _BUILTIN:
        raise ValueError(f"predictors {name!r} are already registered")
    _FACTORIES[name] = factory


def predictor_names() -> list[str]:
    return sorted({*_BUILTIN, *_FACTORIES})


def make_predictors(name: str, **params: Any) -> Predictors:
    """The bundle registered as ``name``; ValueError listing the known names otherwise."""
    factory = _FACTORIES.get(name)
    if factory is None:
        path = _BUILTIN.get(name)
        if path is None:
            raise ValueError(f"unknown predictors {name!r}; known: {', '.join(predictor_names())}")
        module, attr = path.split(":")
        factory = _FACTORIES[name] = getattr(importlib.import_module(module), attr)
    return factory(**params)
