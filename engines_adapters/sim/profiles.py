"""Named hardware/model profiles (``profiles.json``): the public facts an engine's timing is
derived from. The sim engine model turns them into step times; analytic predictors may use the
same public facts (never the engine model's formulas)."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import cache
from importlib import resources
from typing import Any

GB = 1e9


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    model: dict[str, Any]
    hardware: dict[str, Any]
    efficiency: dict[str, Any]
    sources: tuple[str, ...] = ()

    @property
    def kv_bytes_per_token(self) -> int:
        m = self.model
        return 2 * m["layers"] * m["kv_heads"] * m["head_dim"] * m["dtype_bytes"]

    @property
    def weight_bytes(self) -> float:
        return self.model["params"] * self.model["dtype_bytes"]

    @property
    def max_model_len(self) -> int:
        return int(self.model["max_model_len"])

    @property
    def kv_capacity_tokens(self) -> int:
        """KV tokens that fit on the devices after weights and activations (vLLM's budget)."""
        hw, eff = self.hardware, self.efficiency
        usable = hw["gpus"] * hw["hbm_gb"] * GB * eff["gpu_memory_utilization"]
        free = usable - self.weight_bytes - eff["activation_reserve_gb"] * GB
        return max(0, int(free // self.kv_bytes_per_token))

    @property
    def host_capacity_tokens(self) -> int:
        return int(self.hardware["host_mem_gb"] * GB // self.kv_bytes_per_token)

    @property
    def net_bytes_per_s(self) -> float:
        return self.hardware["net_gbps"] * GB

    @property
    def host_bytes_per_s(self) -> float:
        return self.hardware.get("host_gbps", self.hardware["net_gbps"]) * GB

    @property
    def served_name(self) -> str:
        """Short model name a server answers to (the full HF name is accepted too)."""
        return self.model.get("served_name") or self.model["name"].rsplit("/", 1)[-1]

    def with_overrides(self, *, hardware: dict[str, Any] | None = None,
                       efficiency: dict[str, Any] | None = None) -> "Profile":
        """A copy with some hardware/efficiency entries replaced (calibration what-ifs)."""
        return replace(self, hardware={**self.hardware, **(hardware or {})},
                       efficiency={**self.efficiency, **(efficiency or {})})


@cache
def _all() -> dict[str, dict[str, Any]]:
    return json.loads(resources.files("engines_adapters.sim").joinpath("profiles.json").read_text())


def profile_names() -> list[str]:
    return sorted(_all())


_registered: dict[str, Profile] = {}


def time_scaled(p: Profile, scale: float) -> Profile:
    """The profile of hardware ``scale`` times slower: how an engine run with ``--time-scale
    scale`` looks in wall-clock time (rates divided, fixed latencies multiplied), so predictions
    made from it are in the same seconds the gateway measures."""
    if scale == 1:
        return p
    hw = {k: (v / scale if k == "peak_tflops" or k.endswith("_gbps") else v) for k, v in p.hardware.items()}
    eff = {k: (v * scale if k.endswith(("_ms", "_us")) else v) for k, v in p.efficiency.items()}
    return replace(p, name=f"{p.name}@time-scale-{scale:g}", hardware=hw, efficiency=eff)


def register_profile(p: Profile) -> None:
    """Make a derived profile loadable by its name (e.g. a time-scaled one)."""
    _registered[p.name] = p


def load_profile(name: str) -> Profile:
    if name in _registered:
        return _registered[name]
    raw = _all().get(name)
    if raw is None:
        raise KeyError(f"unknown profile {name!r}; known: {', '.join(profile_names())}")
    return Profile(name=name, description=raw["description"], model=raw["model"], hardware=raw["hardware"],
                   efficiency=raw["efficiency"], sources=tuple(raw.get("sources", ())))
