"""Gateway configuration: a TOML file (documented in docs/gateway.md, example in
examples/conductor.toml), or nothing for the embedded simulated cluster."""
from __future__ import annotations

import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.auth import AuthConfig, AuthConfigError, parse_auth
from gateway.tenants import DEFAULT_PRIORITY_HEADROOM
from predictors.analytic import Prior
from predictors.facts import load_deployment
from predictors.telemetry import SLO
from predictors.types import ROLES
from scheduler.admission import check_headroom

KINDS = ("vllm", "sglang", "sim")
#: The PD protocol (engine flavour, ``engines_adapters.drivers.FLAVORS``) an engine speaks unless
#: its ``protocol`` says otherwise: the sim engine mirrors vLLM 0.33 by default.
KIND_PROTOCOLS = {"vllm": "vllm", "sglang": "sglang", "sim": "vllm"}
EMBEDDED_ENGINES = ("vllm", "sglang", "vllm-mooncake")  # the PD protocol the embedded sim engines speak
TOKENIZERS = ("builtin", "engine", "hf")
PREDICTORS = ("analytic", "learned")


class ConfigError(ValueError):
    """A configuration the gateway cannot run with (one-line message)."""


@dataclass
class EngineConfig:
    id: str
    role: str
    url: str
    kind: str = "vllm"
    kv_events: str | None = None  # endpoint the gateway's SUB binds/connects (vLLM's rule, mirrored)
    kv_events_replay: str | None = None  # the engine's replay (ROUTER) endpoint
    deployment: str = "llama3-8b-h200"  # public facts the predictors read (predictors/facts.json)
    kv_capacity_tokens: int | None = None  # None: estimated, then learned from the engine's /metrics
    max_model_len: int | None = None  # None: the model card's
    profile: str | None = None  # deprecated alias of deployment
    api_key: str | None = field(default=None, repr=False)  # sent as a Bearer token (vLLM --api-key)
    # model names (base models, LoRA adapters) routed to this engine; None: all its /v1/models lists
    models: list[str] | None = None
    protocol: str | None = None  # PD protocol / engine flavour; None: the kind's (KIND_PROTOCOLS)
    bootstrap_port: int | None = None  # SGLang prefill: its bootstrap server's port (None: 8998)

    @property
    def flavor(self) -> str:
        return self.protocol or KIND_PROTOCOLS[self.kind]


@dataclass
class StoreConfig:
    """The shared KV store the gateway reads (docs/store.md): the Mooncake master's admin HTTP."""

    url: str = ""  # the master's metrics/admin HTTP, e.g. http://127.0.0.1:9003
    kv_events: str | None = None  # the master's KV-event PUB endpoint (events mode); None: query mode
    key_recipe: str = "vllm"  # the engines' store keys: vllm (MooncakeStoreConnector) or sglang (HiCache)
    model: str | None = None  # model name inside keys (default: the embedded engines' model)
    hash_seed: str | None = "0"  # the engines' PYTHONHASHSEED (vLLM's chain seed); None: the gateway's own
    hash_algo: str = "sha256"  # the engines' --prefix-caching-hash-algo (vllm recipe)
    optional: bool = False  # unreachable at start: warn and run without (else exit 2)
    cache_ttl_s: float = 1.0  # query mode: how long an answer is trusted
    cache_max_keys: int = 1_000_000
    timeout_s: float = 1.0
    # a real Mooncake store (docs/store.md §7): kind "mooncake"; serve starts its master on loopback
    # (start_master, url then left empty), or attaches to one whose RPC address master_rpc names;
    # either way the embedded engines put and get real bytes through it
    kind: str = "sim"  # sim: anything answering the master's admin HTTP; mooncake: a real mooncake_master
    start_master: bool = False
    master_bin: str | None = None  # default: mooncake_master beside this Python, else on PATH
    master_args: list[str] = field(default_factory=list)  # extra mooncake_master flags
    master_rpc: str | None = None  # "127.0.0.1:PORT" of an attached master (set when serve starts one)


@dataclass
class EmbeddedConfig:
    prefill: int = 2
    decode: int = 2
    both: int = 0
    profile: str = "llama3-8b-h200"  # the sim engines' --profile (its public deployment is scheduled on)
    time_scale: float = 1.0
    seed: int = 0
    engine: str = "vllm"  # the protocol the sim engines speak: vllm, sglang or vllm-mooncake
    extra_args: list[str] = field(default_factory=list)
    # a conductor sim-store beside the engines: prefill engines load from it and write through,
    # and the gateway's store tier reads its KV events
    store: bool = True
    store_gb: float = 64.0
    store_write: str = "through"  # the engines' --kv-store-write: through (HiCache's default) | back


@dataclass
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "conductor"
    slo: SLO = field(default_factory=lambda: SLO(ttft_s=30.0, tbt_s=0.2))
    block_size: int = 16
    tokenizer: str = "builtin"
    tokenizer_path: str | None = None
    engines: list[EngineConfig] = field(default_factory=list)
    embedded: EmbeddedConfig | None = field(default_factory=EmbeddedConfig)
    max_body_bytes: int = 8 * 1024 * 1024
    upstream_connect_timeout_s: float = 5.0
    # an engine's first byte: the prefill leg's whole answer, a streamed decode leg's headers
    # (exceeded: retried on another pair once, else 504; counted toward ejection unless the
    # engine answered another request meanwhile: then it was a queue, not a hang)
    upstream_first_byte_timeout_s: float = 60.0
    upstream_stall_timeout_s: float = 30.0  # a stream silent this long mid-way: SSE error, released
    upstream_timeout_s: float = 300.0  # a whole non-streamed answer
    default_max_tokens: int = 256
    health_interval_s: float = 0.5
    health_timeout_s: float = 0.8  # a probe not answered in this long failed (a hung engine)
    eject_after_failures: int = 2
    # client connections (gateway/netguard.py): 0 = derived from the open-file limit
    max_connections: int = 0
    max_concurrent_requests: int = 0  # /v1 requests in progress; beyond: 503 + Retry-After; 0 = max_connections
    header_timeout_s: float = 10.0  # request line + headers must arrive within this (else 408 / close)
    body_timeout_s: float = 30.0  # the body must arrive within this after the headers (else 408)
    keepalive_timeout_s: float = 5.0  # an idle keep-alive connection is closed after this
    max_header_bytes: int = 65536  # request line + headers larger than this: 431 and close
    shutdown_timeout_s: float = 8.0  # SIGTERM: in-flight streams get most of it, then everything stops
    telemetry_path: str | None = None
    otel_exporter: str = "none"  # none | console | otlp
    otel_endpoint: str | None = None
    early_rejection: bool = False
    # false: never answer 429 for a predicted SLO miss (how the peer routers ship; for A/B runs)
    admission: bool = True
    # vLLM's two-step PD (and the sim engine) cannot fetch a prefix from another prefill instance:
    # only the shared store is a pull source unless the engines can (conductor policy only)
    peer_kv_pull: bool = False
    keep_decisions: int = 1000
    policy_params: dict[str, Any] = field(default_factory=dict)
    prior: Prior = field(default_factory=Prior)  # the analytic predictors' rules of thumb ([prior])
    store: StoreConfig | None = None  # the shared KV store ([store]); the embedded one when it runs
    # "analytic" (the roofline over public facts) or "learned" (conductor calibrate's models in
    # predictor_models; a term without a valid model falls back to analytic, logged)
    predictors: str = "analytic"
    predictor_models: str | None = None
    predictor_online: bool = True  # online EWMA correction of the learned terms
    # the online p90 tracker's step (predictors/online_quantile.py; 0: the calibrated p90 as is);
    # None: the step conductor calibrate tuned on its training rows (models.json), else 0.05
    predictor_quantile_eta: float | None = None
    auth: AuthConfig = field(default_factory=AuthConfig)  # [auth]: client keys, admin token, hosts (gateway/auth.py)
    # a prompt longer than the longest served context (max_model_len) x this many characters a
    # token is refused before tokenizing; default: 1 for the built-in byte tokenizer (exact: a
    # character is at least one byte-token), 8 for the others (natural text averages about 4)
    prompt_chars_per_token: float | None = None
    # priority class -> fraction of the SLO admission admits its requests up to (keys name their
    # class: [auth.api_keys.NAME] priority = "..."); the given classes replace the defaults'
    priority_headroom: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_PRIORITY_HEADROOM))


def _take(section: Any, cls, where: str):
    if not isinstance(section, dict):
        raise ConfigError(f"{where}: expected a table, got {section!r}")
    known = set(cls.__dataclass_fields__)
    unknown = set(section) - known
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    hints = typing.get_type_hints(cls)
    for key, value in section.items():
        want = _kind(hints[key], value)
        if want is not None:
            raise ConfigError(f"{where}: {key} must be {want}, got {value!r}")
    try:
        return cls(**section)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None


_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string", list: "a list",
          dict: "a table"}


def _kind(hint: Any, value: Any) -> str | None:
    """What a TOML value of a field annotated ``hint`` should have been, or None when it is one
    (a field of another type is parsed, and checked, by its own section)."""
    args = typing.get_args(hint)
    if type(None) in args:  # X | None
        if value is None:
            return None
        rest = [a for a in args if a is not type(None)]
        hint = rest[0] if len(rest) == 1 else hint
    base = typing.get_origin(hint) or hint
    if base not in _KINDS:
        return None
    if isinstance(value, bool):
        ok = base is bool
    else:
        ok = isinstance(value, (int, float)) if base is float else isinstance(value, base)
    return None if ok else _KINDS[base]


def parse_config(raw: dict[str, Any], environ: Mapping[str, str] | None = None) -> GatewayConfig:
    raw = dict(raw)
    engines_raw = raw.pop("engines", [])
    if not isinstance(engines_raw, list):
        raise ConfigError("engines: expected a list of tables, [[engines]]")
    engines = [_take(e, EngineConfig, f"engines[{i}]") for i, e in enumerate(engines_raw)]
    embedded_raw = raw.pop("embedded", None)
    slo_raw = raw.pop("slo", None)
    prior_raw = raw.pop("prior", None)
    store_raw = raw.pop("store", None)
    auth_raw = raw.pop("auth", None)
    cfg = _take(raw, GatewayConfig, "config")
    try:
        cfg.auth = parse_auth(auth_raw, environ)
    except AuthConfigError as e:
        raise ConfigError(str(e)) from None
    cfg.engines = engines
    if slo_raw is not None:
        if not isinstance(slo_raw, dict):
            raise ConfigError(f"slo: expected a table (ttft_ms, tbt_ms), got {slo_raw!r}")
        unknown = set(slo_raw) - {"ttft_ms", "tbt_ms"}
        if unknown:
            raise ConfigError(f"slo: unknown key(s) {', '.join(sorted(unknown))}")
        cfg.slo = SLO(ttft_s=_ms(slo_raw.get("ttft_ms")), tbt_s=_ms(slo_raw.get("tbt_ms")))
    if prior_raw is not None:
        cfg.prior = _prior(prior_raw)
    if store_raw is not None:
        if not isinstance(store_raw, dict):
            raise ConfigError("store: expected a table")
        cfg.store = _take(store_raw, StoreConfig, "store")
    if engines:
        cfg.embedded = None if embedded_raw is None else _take(embedded_raw, EmbeddedConfig, "embedded")
    elif embedded_raw is not None:
        cfg.embedded = _take(embedded_raw, EmbeddedConfig, "embedded")
    validate(cfg)
    if cfg.auth.engine_api_key and cfg.embedded is not None:  # the embedded engines demand the key they are sent
        cfg.embedded.extra_args = [*cfg.embedded.extra_args, "--api-key", cfg.auth.engine_api_key]
    return cfg


def _validate_mooncake(st: StoreConfig) -> None:
    if st.kind not in ("sim", "mooncake"):
        raise ConfigError(f"store: kind must be sim or mooncake, got {st.kind!r}")
    if (st.start_master or st.master_rpc) and st.kind != "mooncake":
        raise ConfigError('store: start_master and master_rpc need kind = "mooncake"')
    if st.start_master and (st.url or st.master_rpc):
        raise ConfigError("store: start_master chooses the master's ports itself: leave url and master_rpc out")
    if not isinstance(st.master_args, list) or not all(isinstance(a, str) for a in st.master_args):
        raise ConfigError("store: master_args must be a list of strings")
    if st.master_rpc is not None:
        host, _, port_ = str(st.master_rpc).rpartition(":")
        if host not in ("127.0.0.1", "localhost") or not port_.isdigit() or not 0 < int(port_) < 65536:
            raise ConfigError(f"store: master_rpc must be 127.0.0.1:PORT (loopback only), got {st.master_rpc!r}")


def _prior(raw: Any) -> Prior:
    if not isinstance(raw, dict):
        raise ConfigError("prior: expected a table of rules of thumb")
    unknown = set(raw) - set(Prior.field_names())
    if unknown:
        raise ConfigError(f"prior: unknown key(s) {', '.join(sorted(unknown))}; "
                          f"known: {', '.join(Prior.field_names())}")
    try:
        return Prior(**raw)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"prior: {e}") from None


def _ms(v: Any) -> float | None:
    if v is None:
        return None
    if not isinstance(v, (int, float)) or v <= 0:
        raise ConfigError(f"slo: milliseconds must be positive numbers, got {v!r}")
    return v / 1000.0


def validate(cfg: GatewayConfig) -> None:
    seen = set()
    for e in cfg.engines:
        if e.id in seen:
            raise ConfigError(f"engines: duplicate id {e.id!r}")
        seen.add(e.id)
        if e.role not in ROLES:
            raise ConfigError(f"engine {e.id}: role must be one of {ROLES}, got {e.role!r}")
        if e.kind not in KINDS:
            raise ConfigError(f"engine {e.id}: kind must be one of {KINDS}, got {e.kind!r}")
        if not e.url.startswith(("http://", "https://")):
            raise ConfigError(f"engine {e.id}: url must be http(s)://..., got {e.url!r}")
        if e.profile is not None:  # the deprecated name of the same key
            if e.deployment not in (e.profile, EngineConfig.deployment):
                raise ConfigError(f"engine {e.id}: give deployment or its deprecated alias profile, not both")
            e.deployment, e.profile = e.profile, None
        try:
            load_deployment(e.deployment)
        except KeyError as err:
            raise ConfigError(f"engine {e.id}: {err.args[0]}") from None
        if e.models is not None and (not isinstance(e.models, list) or not e.models
                                     or not all(isinstance(m, str) and m for m in e.models)):
            raise ConfigError(f"engine {e.id}: models must be a non-empty list of model names")
        from engines_adapters.drivers import FLAVORS

        if e.protocol is not None and e.protocol not in FLAVORS:
            raise ConfigError(f"engine {e.id}: protocol must be one of {tuple(FLAVORS)}, got {e.protocol!r}")
        bp = e.bootstrap_port
        if bp is not None and (not isinstance(bp, int) or isinstance(bp, bool) or not 0 < bp < 65536):
            raise ConfigError(f"engine {e.id}: bootstrap_port must be a TCP port, got {bp!r}")
        if e.api_key is not None and (not isinstance(e.api_key, str) or not e.api_key):
            raise ConfigError(f"engine {e.id}: api_key must be a non-empty string")
        for name in ("kv_capacity_tokens", "max_model_len"):
            v = getattr(e, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise ConfigError(f"engine {e.id}: {name} must be a positive integer, got {v!r}")
    check_protocol_pairs(cfg.engines)
    if not cfg.engines and cfg.embedded is None:
        raise ConfigError("no engines configured and the embedded cluster is disabled")
    if cfg.embedded is not None:
        em = cfg.embedded
        if min(em.prefill, em.decode, em.both) < 0 or em.prefill + em.decode + em.both == 0:
            raise ConfigError("embedded: need at least one engine")
        if (em.prefill == 0) != (em.decode == 0):
            raise ConfigError("embedded: prefill and decode engines come in pairs (or use 'both')")
        if em.engine not in EMBEDDED_ENGINES:
            raise ConfigError(f"embedded: engine must be one of {EMBEDDED_ENGINES}, got {em.engine!r}")
        if em.time_scale <= 0:
            raise ConfigError("embedded: time_scale must be > 0")
        from engines_adapters.sim.profiles import profile_names  # the sim engines' own profiles

        if em.profile not in profile_names():
            raise ConfigError(f"embedded: unknown profile {em.profile!r}; known: {', '.join(profile_names())}")
    if cfg.store is not None:
        st = cfg.store
        _validate_mooncake(st)
        if not st.start_master and not st.url.startswith(("http://", "https://")):
            raise ConfigError(f"store: url must be http(s)://... (the master's admin HTTP), got {st.url!r}")
        if st.key_recipe not in ("vllm", "sglang"):
            raise ConfigError(f"store: key_recipe must be vllm or sglang, got {st.key_recipe!r}")
        if st.kv_events is not None and not str(st.kv_events).startswith("tcp://"):
            raise ConfigError(f"store: kv_events must be a tcp:// endpoint, got {st.kv_events!r}")
        if st.cache_ttl_s < 0 or st.timeout_s <= 0 or st.cache_max_keys <= 0:
            raise ConfigError("store: cache_ttl_s must be >= 0, timeout_s and cache_max_keys > 0")
        if st.model is None and cfg.embedded is None:
            raise ConfigError("store: model is required (the engines' model name, as it appears in store keys)")
    if cfg.embedded is not None and cfg.embedded.store_gb <= 0:
        raise ConfigError("embedded: store_gb must be > 0")
    if cfg.embedded is not None and cfg.embedded.store_write not in ("through", "back"):
        raise ConfigError(f"embedded: store_write must be 'through' or 'back', got {cfg.embedded.store_write!r}")
    if cfg.predictors not in PREDICTORS:
        raise ConfigError(f"predictors must be one of {PREDICTORS}, got {cfg.predictors!r}")
    if cfg.predictors == "learned" and not cfg.predictor_models:
        raise ConfigError("predictors 'learned' needs predictor_models (a directory written by conductor calibrate)")
    eta = cfg.predictor_quantile_eta
    if eta is not None and (isinstance(eta, bool) or not isinstance(eta, (int, float)) or not 0 <= eta <= 1):
        raise ConfigError(f"predictor_quantile_eta must be a number in [0, 1], got {eta!r}")
    if cfg.tokenizer not in TOKENIZERS:
        raise ConfigError(f"tokenizer must be one of {TOKENIZERS}, got {cfg.tokenizer!r}")
    if cfg.tokenizer == "hf" and not cfg.tokenizer_path:
        raise ConfigError("tokenizer 'hf' needs tokenizer_path (a Hugging Face tokenizer directory)")
    if cfg.block_size <= 0 or cfg.max_body_bytes <= 0 or cfg.default_max_tokens <= 0:
        raise ConfigError("block_size, max_body_bytes and default_max_tokens must be positive")
    _check_network(cfg)
    if cfg.otel_exporter not in ("none", "console", "otlp"):
        raise ConfigError(f"otel_exporter must be none, console or otlp, got {cfg.otel_exporter!r}")
    if not isinstance(cfg.priority_headroom, dict):
        raise ConfigError("priority_headroom: expected a table of class = fraction of the SLO")
    headroom = {**DEFAULT_PRIORITY_HEADROOM, **cfg.priority_headroom}
    try:
        cfg.priority_headroom = check_headroom(headroom)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for k in cfg.auth.api_keys.values():
        if k.tenant.priority not in cfg.priority_headroom:
            raise ConfigError(f"auth.api_keys.{k.name}.priority: unknown class {k.tenant.priority!r}; "
                              f"known: {', '.join(cfg.priority_headroom)} (add it to priority_headroom)")
    cpt = cfg.prompt_chars_per_token
    if cpt is not None and (isinstance(cpt, bool) or not isinstance(cpt, (int, float)) or not cpt >= 1):
        raise ConfigError(f"prompt_chars_per_token must be a number >= 1, got {cpt!r}")


def _check_network(cfg: GatewayConfig) -> None:
    for name in ("upstream_connect_timeout_s", "upstream_first_byte_timeout_s", "upstream_stall_timeout_s",
                 "upstream_timeout_s", "health_interval_s", "health_timeout_s", "header_timeout_s",
                 "body_timeout_s", "keepalive_timeout_s", "shutdown_timeout_s"):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ConfigError(f"{name} must be a positive number of seconds, got {v!r}")
    for name, least in (("max_connections", 0), ("max_concurrent_requests", 0), ("max_header_bytes", 1),
                        ("eject_after_failures", 1)):
        v = getattr(cfg, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < least:
            raise ConfigError(f"{name} must be an integer >= {least}, got {v!r}")


def check_protocol_pairs(engines: list[EngineConfig]) -> None:
    """KV never crosses engine families: every prefill-only instance needs a decode-only one
    speaking its protocol, and the other way round (a "both" instance serves alone)."""
    by_role: dict[str, dict[str, list[str]]] = {"prefill": {}, "decode": {}}
    for e in engines:
        if e.role in by_role:
            by_role[e.role].setdefault(e.flavor, []).append(e.id)
    for role, other in (("prefill", "decode"), ("decode", "prefill")):
        for proto, ids in by_role[role].items():
            if proto not in by_role[other] and by_role[other]:
                peers = ", ".join(f"{i} ({p})" for p, group in by_role[other].items() for i in group)
                raise ConfigError(f"engine {ids[0]} ({proto} {role}) has no {other} instance speaking {proto}; "
                                  f"the {other} instances are {peers}: a pair never mixes protocols")


def load_config(path: str | None) -> GatewayConfig:
    if path is None:
        return GatewayConfig()
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config {path} is not valid TOML: {e}") from None
    return parse_config(raw)
