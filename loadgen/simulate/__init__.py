"""``conductor simulate``: whole traces in virtual time through the live scheduler and the sim
engine's model (see docs/simulate.md)."""
from .cli import main

__all__ = ["main"]
