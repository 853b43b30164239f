"""Public facts: what a datasheet and a model card say about a deployment, nothing measured.

``facts.json`` holds models (layer shapes from their ``config.json``), GPUs (datasheet peak
FLOP/s, HBM bandwidth and size, NVLink) and named deployments (a model on N GPUs with a NIC and
host memory). Predictors and the scheduler may read these; an engine's own calibration (how
efficiently *it* uses the hardware) is private to that engine and never lives here.

A name ``<deployment>@time-scale-<X>`` loads the deployment as seen from a gateway whose engines
run ``X`` times slower than the hardware (the simulated engine's ``--time-scale``): the operator
who chose X knows it, so it is a public fact too.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from functools import cache
from importlib import resources
from typing import Any

GB = 1e9

#: Suffix of a time-scaled deployment's name (``llama3-8b-h200@time-scale-0.5``).
TIME_SCALE_SEP = "@time-scale-"

#: vLLM's default ``--gpu-memory-utilization``: the share of HBM it takes for weights,
#: activations and the KV cache.
VLLM_GPU_MEMORY_UTILIZATION = 0.9
#: A generic per-GPU reserve for the activation peak of vLLM's profiling pass, CUDA graphs and
#: non-torch allocations (a few GB per GPU is typical); only for the capacity *estimate*.
ACTIVATION_RESERVE_GB_PER_GPU = 3.0


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """A model's shape, from its model card / ``config.json``."""

    name: str
    served_name: str
    params: float
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    max_model_len: int

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token (GQA: kv_heads, not heads)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class GPUFacts:
    """One GPU's datasheet figures (dense BF16 FLOP/s, HBM, NVLink per direction)."""

    name: str
    peak_tflops: float
    hbm_gbps: float
    hbm_gb: float
    nvlink_gbps: float


@dataclass(frozen=True, slots=True)
class Deployment:
    """A named instance shape: a model on ``gpus`` GPUs (tensor parallel), its NIC and host memory.

    Frozen and hashable, so equal deployments can share memoised predictions.
    ``time_scale`` > 1 means the engines run that many times slower than this hardware: its rates
    are already divided by it, and fixed latencies a predictor adds must be multiplied by it.
    """

    name: str
    model: ModelFacts
    gpu: GPUFacts
    gpus: int = 1
    net_gbps: float = 50.0
    host_mem_gb: float = 0.0
    host_gbps: float = 50.0
    time_scale: float = 1.0
    description: str = ""
    sources: tuple[str, ...] = field(default=(), compare=False)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    @property
    def weight_bytes(self) -> float:
        return self.model.weight_bytes

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len

    @property
    def net_bytes_per_s(self) -> float:
        return self.net_gbps * GB

    @property
    def host_bytes_per_s(self) -> float:
        return self.host_gbps * GB

    @property
    def host_capacity_tokens(self) -> int:
        """KV tokens the host memory could hold (an upper bound: engines use a configured part)."""
        return int(self.host_mem_gb * GB // self.kv_bytes_per_token)

    def estimated_kv_capacity_tokens(self, gpu_memory_utilization: float = VLLM_GPU_MEMORY_UTILIZATION,
                                     activation_reserve_gb_per_gpu: float = ACTIVATION_RESERVE_GB_PER_GPU) -> int:
        """An *estimate* of the device KV capacity, vLLM's way: its share of HBM minus the
        weights minus an activation reserve, in tokens. Used until the engine reports its own
        (vLLM's ``vllm:cache_config_info``: num_gpu_blocks x block_size)."""
        usable = self.gpus * self.gpu.hbm_gb * GB * gpu_memory_utilization
        free = usable - self.weight_bytes - self.gpus * activation_reserve_gb_per_gpu * GB
        return max(0, int(free // self.kv_bytes_per_token))

    def time_scaled(self, scale: float) -> "Deployment":
        """This deployment seen from a gateway whose engines run ``scale`` times slower: rates
        (FLOP/s, HBM, NVLink, NIC and host bandwidth) divided by ``scale``; sizes unchanged."""
        if scale <= 0:
            raise ValueError(f"time scale must be > 0, got {scale}")
        if scale == 1:
            return self
        gpu = replace(self.gpu, peak_tflops=self.gpu.peak_tflops / scale, hbm_gbps=self.gpu.hbm_gbps / scale,
                      nvlink_gbps=self.gpu.nvlink_gbps / scale)
        base = self.name.split(TIME_SCALE_SEP, 1)[0]
        total = self.time_scale * scale
        return replace(self, name=f"{base}{TIME_SCALE_SEP}{total:g}", gpu=gpu, net_gbps=self.net_gbps / scale,
                       host_gbps=self.host_gbps / scale, time_scale=total)


@cache
def _facts() -> dict[str, Any]:
    raw: dict[str, Any] = json.loads(resources.files("predictors").joinpath("facts.json").read_text())
    return raw


def deployment_names() -> list[str]:
    return sorted(_facts()["deployments"])


def _model(name: str) -> ModelFacts:
    raw = dict(_facts()["models"][name])
    raw.pop("sources", None)
    return ModelFacts(name=name, **raw)


def _gpu(name: str) -> GPUFacts:
    raw = dict(_facts()["gpus"][name])
    raw.pop("sources", None)
    return GPUFacts(name=name, **raw)


@cache
def _base(name: str) -> Deployment:
    facts = _facts()
    raw = facts["deployments"].get(name)
    if raw is None:
        raise KeyError(f"unknown deployment {name!r}; known: {', '.join(deployment_names())}")
    sources = (*facts["gpus"][raw["gpu"]].get("sources", ()), *facts["models"][raw["model"]].get("sources", ()),
               *raw.get("sources", ()))
    return Deployment(name=name, model=_model(raw["model"]), gpu=_gpu(raw["gpu"]), gpus=int(raw["gpus"]),
                      net_gbps=float(raw["net_gbps"]), host_mem_gb=float(raw["host_mem_gb"]),
                      host_gbps=float(raw.get("host_gbps", raw["net_gbps"])), description=raw.get("description", ""),
                      sources=tuple(sources))


def load_deployment(name: str) -> Deployment:
    """A named deployment, or ``<name>@time-scale-<X>`` for it time-scaled; KeyError (listing
    the known names) for anything else."""
    if not isinstance(name, str):
        raise KeyError(f"deployment name must be a string, got {name!r}")
    base, sep, scale = name.partition(TIME_SCALE_SEP)
    d = _base(base)
    if not sep:
        return d
    try:
        factor = float(scale)
    except ValueError:
        factor = 0.0
    if not factor > 0 or factor == float("inf"):
        raise KeyError(f"bad time scale in deployment {name!r}: expected {base}{TIME_SCALE_SEP}<positive number>")
    return d.time_scaled(factor)
