"""Pure scheduling decisions: hashing, hit index, ledger, cost model, policies, admission. No I/O."""
from predictors.telemetry import SLO
from scheduler.explain import format_lines
from scheduler.hit_index import HitIndex, Match
from scheduler.ledger import Ledger, Reservation
from scheduler.scheduler import Scheduler
from scheduler.types import BOTH, DECODE, PREFILL, STORE, Instance, Placement, Rejection, RequestFacts

__all__ = ["BOTH", "DECODE", "PREFILL", "SLO", "STORE", "HitIndex", "Instance", "Ledger", "Match", "Placement",
           "Rejection", "RequestFacts", "Reservation", "Scheduler", "format_lines"]
