"""Policies behind one interface: Algorithm 1 and the peer baselines, by name."""
from __future__ import annotations

from typing import Any

from scheduler.policies.base import DecodeChoice, Policy, PrefillChoice
from scheduler.policies.conductor import ConductorAlg1Policy, ConductorPolicy
from scheduler.policies.dynamo import DynamoCostPolicy
from scheduler.policies.lmetric import LMetricPolicy
from scheduler.policies.prefix_only import PrefixOnlyPolicy
from scheduler.policies.sglang import SGLangCacheAwarePolicy
from scheduler.policies.simple import LeastLoadedPolicy, RandomPolicy, RoundRobinPolicy

POLICIES: dict[str, type[Policy]] = {p.name: p for p in (
    ConductorPolicy, ConductorAlg1Policy, RoundRobinPolicy, RandomPolicy, LeastLoadedPolicy, PrefixOnlyPolicy,
    SGLangCacheAwarePolicy, DynamoCostPolicy, LMetricPolicy)}


def make_policy(name: str, **params: Any) -> Policy:
    """Build a policy by name; ValueError for an unknown name or parameter."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    return cls(**params)


__all__ = ["POLICIES", "DecodeChoice", "Policy", "PrefillChoice", "make_policy"]
