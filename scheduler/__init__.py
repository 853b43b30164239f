"""Pure scheduling decisions: hashing, hit index, ledger, cost model, policies, admission. No I/O."""
from predictors.telemetry import SLO
from predictors.types import Role, Tier
from scheduler.explain import format_lines
from scheduler.hit_index import HitIndex, Match
from scheduler.ledger import Ledger, Reservation
from scheduler.scheduler import Scheduler
from scheduler.types import Instance, Placement, Rejection, RequestFacts

__all__ = ["SLO", "HitIndex", "Role", "Tier", "Instance", "Ledger", "Match", "Placement",
           "Rejection", "RequestFacts", "Reservation", "Scheduler", "format_lines"]
