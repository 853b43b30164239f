"""Sim engine profiles: a public :class:`~predictors.facts.Deployment` plus this engine's private
calibration (``profiles.json``: efficiencies, overheads, blend, memory budget).

The deployment (datasheet and model-card facts) is what anyone may know; the calibration is how
efficiently *this* engine runs on it, and it stays here: the scheduler and the predictors never
read it, so their predictions are graded against an engine they do not share constants with.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from functools import cache
from importlib import resources
from typing import Any

from predictors.facts import GB, Deployment, load_deployment

#: ``with_overrides(hardware=...)`` keys that belong to the GPU rather than the deployment.
_GPU_KEYS = frozenset({"name", "peak_tflops", "hbm_gbps", "hbm_gb", "nvlink_gbps"})
_DEPLOYMENT_KEYS = frozenset({"gpus", "net_gbps", "host_mem_gb", "host_gbps"})


@dataclass(frozen=True)
class Profile:
    name: str
    deployment: Deployment
    efficiency: dict[str, Any]
    sources: tuple[str, ...] = ()

    @property
    def description(self) -> str:
        return self.deployment.description

    @property
    def model(self) -> dict[str, Any]:
        """The model's facts as a plain mapping (what the step timer reads)."""
        m = self.deployment.model
        return {f.name: getattr(m, f.name) for f in fields(m)}

    @property
    def hardware(self) -> dict[str, Any]:
        """The GPU and deployment facts as one plain mapping (what the step timer reads)."""
        d, g = self.deployment, self.deployment.gpu
        return {"gpu": g.name, "gpus": d.gpus, "peak_tflops": g.peak_tflops, "hbm_gbps": g.hbm_gbps,
                "hbm_gb": g.hbm_gb, "nvlink_gbps": g.nvlink_gbps, "net_gbps": d.net_gbps,
                "host_mem_gb": d.host_mem_gb, "host_gbps": d.host_gbps}

    @property
    def kv_bytes_per_token(self) -> int:
        return self.deployment.kv_bytes_per_token

    @property
    def weight_bytes(self) -> float:
        return self.deployment.weight_bytes

    @property
    def max_model_len(self) -> int:
        return self.deployment.max_model_len

    @property
    def kv_capacity_tokens(self) -> int:
        """KV tokens that fit on the devices after weights and activations (vLLM's budget, with
        this engine's own memory utilisation and activation reserve)."""
        d, eff = self.deployment, self.efficiency
        usable = d.gpus * d.gpu.hbm_gb * GB * eff["gpu_memory_utilization"]
        free = usable - self.weight_bytes - eff["activation_reserve_gb"] * GB
        return max(0, int(free // self.kv_bytes_per_token))

    @property
    def host_capacity_tokens(self) -> int:
        return self.deployment.host_capacity_tokens

    @property
    def net_bytes_per_s(self) -> float:
        return self.deployment.net_bytes_per_s

    @property
    def host_bytes_per_s(self) -> float:
        return self.deployment.host_bytes_per_s

    @property
    def served_name(self) -> str:
        """Short model name a server answers to (the full HF name is accepted too)."""
        m = self.deployment.model
        return m.served_name or m.name.rsplit("/", 1)[-1]

    def with_overrides(self, *, hardware: dict[str, Any] | None = None,
                       efficiency: dict[str, Any] | None = None) -> "Profile":
        """A copy with some hardware/efficiency entries replaced (calibration what-ifs)."""
        hw = dict(hardware or {})
        if "gpu" in hw:  # the GPU's name
            hw["name"] = hw.pop("gpu")
        unknown = set(hw) - _GPU_KEYS - _DEPLOYMENT_KEYS
        if unknown:
            raise KeyError(f"unknown hardware key(s) {', '.join(sorted(unknown))}")
        d = self.deployment
        gpu = replace(d.gpu, **{k: v for k, v in hw.items() if k in _GPU_KEYS})
        d = replace(d, gpu=gpu, **{k: v for k, v in hw.items() if k in _DEPLOYMENT_KEYS})
        return replace(self, deployment=d, efficiency={**self.efficiency, **(efficiency or {})})


@cache
def _all() -> dict[str, dict[str, Any]]:
    raw: dict[str, dict[str, Any]] = json.loads(
        resources.files("engines_adapters.sim").joinpath("profiles.json").read_text())
    return raw


def profile_names() -> list[str]:
    return sorted(_all())


def load_profile(name: str) -> Profile:
    raw = _all().get(name)
    if raw is None:
        raise KeyError(f"unknown profile {name!r}; known: {', '.join(profile_names())}")
    return Profile(name=name, deployment=load_deployment(raw["deployment"]), efficiency=raw["efficiency"],
                   sources=(*load_deployment(raw["deployment"]).sources, *raw.get("sources", ())))
