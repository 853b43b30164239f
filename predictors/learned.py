"""Learned predictors: the roofline's own terms as features, weights fitted to telemetry.

Each term is a non-negative linear combination of physical quantities computed from an
instance's public :class:`~predictors.facts.Deployment` at 100% efficiency (seconds of linear
compute, of attention, of weight and KV reads, of bytes over the NIC). A weight is then an
inverse efficiency (or a fixed cost in units of the hardware's own time), so a model fitted on
short prompts still scales like the physics on long ones, and one fitted on one deployment means
something on another (the pooled model). No two features are proportional on one deployment, so
the weights are identifiable. ``conductor calibrate`` (predictors/calibrate.py) fits them; this
module serves them (the features: predictors/learned_features.py; the model file, read and
validated: predictors/learned_models.py; the closed forms served: predictors/learned_compiled.py).

Serving is closed form: a dot product of a few numbers, memoised per (deployment, inputs), as
cheap as the analytic roofline. Per term, an instance's deployment group model answers, else the
pooled model, else the analytic predictor (logged once). An online EWMA of
actual / predicted absorbs drift between calibrations, each term corrected only from
observations *of that term* (prefill from requests that found their prefill instance idle, TBT
from the request's own token gaps, the prefill->decode KV shipment from the hand-over gap);
prefill per instance, TBT and shipment per deployment group (:meth:`LearnedBundle.correction_key`).
With it, each term's calibrated p90 is tracked online per deployment group (adaptive conformal:
predictors/online_quantile.py), so its coverage stays at 90% through drift (:meth:`LearnedBundle.p90`);
both in predictors/learned_online.py.

Model files are plain JSON (``models.json``): no pickle is ever loaded.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

from predictors import learned_online
from predictors.analytic import (
    AnalyticQueue,
    AnalyticTBT,
    AnalyticTransfer,
    DeploymentBook,
    Prior,
    Roofline,
    resident_share,
)
from predictors.base import DecodeState, Predictors
from predictors.facts import Deployment
from predictors.learned_compiled import CompiledTerms, compile_terms
from predictors.learned_features import CHUNK_TOKENS, TERMS, group_of, physics, slowest_share
from predictors.learned_models import MODELS_FILE, LearnedModels, ModelError, TermModel, load_models, parse_models
from predictors.learned_online import Ewma
from predictors.store_traffic import StoreTraffic
from predictors.telemetry import RequestRecord
from predictors.types import Tier

log = logging.getLogger(__name__)

# the model file's reading and validation live in learned_models.py; callers import them from here
__all__ = ["MODELS_FILE", "LearnedBundle", "LearnedModels", "LearnedPredictors", "ModelError", "learned_predictors",
           "load_models", "parse_models"]


#: Resolution of the served prefill correction (0.5%): see :meth:`LearnedBundle.group`.
FACTOR_STEPS = 200


class LearnedBundle:
    """The models being served, the analytic fallback, and the online corrections.

    One object behind all term predictors, so a reload swaps every term at once and the
    scheduler's :class:`Predictors` (and the observers holding its ``observe``) stay the same.
    """

    MEMO_LIMIT = 1 << 16

    def __init__(self, models: LearnedModels | None, book: DeploymentBook | None = None, *, online: bool = True,
                 alpha: float = 0.05, source: str = "", quantile_eta: float | None = None):
        self.book = book if book is not None else DeploymentBook()
        self.models = models if models is not None else LearnedModels({})
        self.source = source
        self.online = online
        self.ewma = {t: Ewma(alpha) for t in TERMS}
        self.ttft_err = Ewma(alpha)
        self._warned: set[tuple[str, str]] = set()
        self.quantile_eta = quantile_eta  # None: the step the calibration tuned (models.json), else DEFAULT_ETA
        self.quantiles = learned_online.trackers(self)
        self._fallback_prefill = _AnalyticPrefillNoMemo(self.book)
        self._fallback_tbt = AnalyticTBT(self.book)
        self._fallback_transfer = AnalyticTransfer(self.book)
        self._phys: dict[int, tuple[Roofline, float, str]] = {}
        self._inst: dict[str, CompiledTerms] = {}
        self._memo: dict[tuple[Hashable, ...], float] = {}
        self.reloads = 0
        # each instance's predictor group, kept current here whenever its answers may change (a
        # correction, a reload, a registration): the scheduler reads it at every decision
        # (Predictors.groups), one shared tuple per distinct group (hashed and compared in C)
        self.groups: dict[str, tuple[int, int]] = {}
        self._interned: dict[tuple[int, int], tuple[int, int]] = {}
        self._traffic: StoreTraffic | None = None  # the scheduler's, read by the store term
        self.decode_cluster = 0.0  # the cluster's decode load the scheduler set for this decision
        self._share_of, self._share = 1, 0.0  # slowest_share for the last max_tokens asked

    def attach_store_traffic(self, traffic: StoreTraffic) -> None:
        """The scheduler's hook: the store traffic it advances before each decision's terms."""
        self._traffic = traffic

    def set_decode_load(self, running_per_instance: float) -> None:
        """The scheduler's hook, once per decision: reservations per eligible decode instance."""
        self.decode_cluster = running_per_instance if running_per_instance > 0 else 0.0

    # --- models --------------------------------------------------------------------------
    def swap(self, models: LearnedModels, source: str) -> None:
        """Serve ``models`` from now on (already validated); corrections start afresh."""
        self.models, self.source = models, source
        self._memo.clear()
        self._inst.clear()
        self._warned.clear()
        self.ewma = {t: Ewma(self.ewma[t].alpha) for t in TERMS}
        self.quantiles = learned_online.trackers(self)
        self.reloads += 1
        self._regroup()

    def _physics(self, instance: str) -> tuple[int, Roofline, float, str]:
        key, _ = self.book.keyed(instance)
        p = self._phys.get(key)
        if p is None:
            entry = self.book.deployment(instance)
            d = entry[0] if entry is not None else None
            if d is None:  # the book's default deployment
                from predictors.facts import load_deployment
                dd = self.book._default_deployment
                d = load_deployment(dd) if isinstance(dd, str) else dd
            group = group_of(d.name)
            p = self._phys[key] = (physics(d), d.time_scale, group)
        return key, p[0], p[1], p[2]

    def model(self, term: str, instance: str) -> tuple[TermModel | None, str]:
        tm = self.models.terms.get(term)
        if tm is None:
            return None, "analytic (no model)"
        group = self._physics(instance)[3]
        m, which = tm.for_group(group)
        return m, which if m is not None else f"analytic (no model for {group})"

    def _warn(self, term: str, why: str) -> None:
        if (term, why) not in self._warned:
            self._warned.add((term, why))
            log.warning("learned predictors: %s answered by the analytic prior: %s", term, why)

    # --- compiled forms: each term's weights folded into the physics' constants ------------
    def register(self, instance: str, deployment: Deployment, kv_capacity_tokens: int) -> None:
        """The scheduler's hook: the instance's public deployment (its compiled terms follow)."""
        self.book.set(instance, deployment, kv_capacity_tokens)
        self._inst.pop(instance, None)
        self._regroup(instance)

    def unregister(self, instance: str) -> None:
        self.book.remove(instance)
        self._inst.pop(instance, None)
        self.groups.pop(instance, None)

    def group(self, instance: str) -> tuple[int, int]:
        """The instance's predictor group for a decision's memo (scheduler/cost.py's ``TermBook``):
        instances of one deployment whose prefill corrections are in the same step answer alike.
        From the first call on, :attr:`groups` holds it, kept current."""
        g = self.groups.get(instance)
        if g is None:
            g = self.groups[instance] = self._group_key(instance)
        return g

    def _group_key(self, instance: str) -> tuple[int, int]:
        key = (self._compiled(instance).key, self.prefill_step(instance))
        if len(self._interned) >= 4096:
            self._interned.clear()
        return self._interned.setdefault(key, key)

    def _regroup(self, instance: str | None = None) -> None:
        """Refresh the group of ``instance`` (None: every instance) after its answers may have changed."""
        for i in (list(self.groups) if instance is None else (instance,)):
            if i in self.groups:
                self.groups[i] = self._group_key(i)

    def _compiled(self, instance: str) -> CompiledTerms:
        c = self._inst.get(instance)
        if c is None:
            key, r, ts, group = self._physics(instance)
            c = self._inst[instance] = compile_terms(self.models, key, r, ts, group, self.book.roofline(instance))
        return c

    # --- base predictions (no online correction) ------------------------------------------
    def prefill_base(self, instance: str, prompt_tokens: int, cached_tokens: int) -> float | None:
        c = self._compiled(instance)
        k = c.prefill
        if k is None:
            self._warn("prefill", f"no model for {c.group}")
            return None
        mk = (c.key, prompt_tokens, cached_tokens)
        t = self._memo.get(mk)
        if t is None:
            prompt = prompt_tokens if prompt_tokens > 1 else 1
            cached = cached_tokens if cached_tokens < prompt - 1 else prompt - 1
            if cached < 0:
                cached = 0
            new = prompt - cached
            sum_ctx2 = (prompt * (prompt + 1) * (2 * prompt + 1) - cached * (cached + 1) * (2 * cached + 1)) / 6.0
            t = (k[0] * -(-new // CHUNK_TOKENS) + k[1] * new + k[2] * new * (cached + (new + 1) / 2.0)
                 + k[3] * sum_ctx2)
            if len(self._memo) >= self.MEMO_LIMIT:
                self._memo.clear()
            self._memo[mk] = t
        return t

    def tbt_base(self, state: DecodeState, prompt_tokens: int, max_tokens: int,
                 cluster: float | None = None) -> float | None:
        """``cluster``: the decode load a record was decided with (None: the current decision's)."""
        c = self._compiled(state.instance)
        k = c.tbt
        if k is None:
            self._warn("tbt", f"no model for {c.group}")
            return None
        kv = (state.kv_tokens if state.kv_tokens > 0 else 0) + (prompt_tokens if prompt_tokens > 0 else 0) + (
            max_tokens if max_tokens > 1 else 1)
        batch = (state.running if state.running > 0 else 0) + 1
        if kv > c.kv_capacity_tokens:  # as tbt_features (a shared cache holds more: resident_share)
            batch, kv = resident_share(batch, kv, c.kv_capacity_tokens, state.kv_share if c.tbt_kv_share else 1.0)
        if max_tokens != self._share_of:  # every candidate of a decision asks with the same max_tokens
            self._share_of, self._share = max_tokens, slowest_share(max_tokens - 1 if max_tokens > 1 else 0)
        return (k[0] + k[1] * kv + k[2] * batch + k[3] * self._share
                + k[4] * (self.decode_cluster if cluster is None else cluster))

    def transfer_base(self, tokens: int, source: str, destination: str, busy_s: float | None = None) -> float | None:
        """``busy_s``: the store links' busy time to use (default: the attached traffic's now)."""
        c = self._compiled(destination)
        if source == Tier.STORE or source == Tier.HOST:  # a load before the prefill (its own term)
            if source == Tier.STORE:
                s = c.store
                if s is None:
                    self._warn(str(source), f"no model of loads from the {source} for {c.group}")
                    return None
                if busy_s is None:
                    busy_s = self._traffic.busy_s if self._traffic is not None else 0.0
                busy, own = busy_s, tokens * s[2]
                return s[0] + tokens * s[1] + (s[3] * (busy - own) if busy > own else 0.0)
            k = c.host
            if k is None:
                self._warn(str(source), f"no model of loads from the {source} for {c.group}")
                return None
            return k[0] + tokens * k[1]
        k = c.transfer
        if k is None:
            self._warn("transfer", f"no model for {c.group}")
            return None
        src_bw = self.book.roofline(source).net_bytes_per_s
        return k[0] + tokens * k[1] / (src_bw if src_bw < c.net_bytes_per_s else c.net_bytes_per_s)

    # --- served predictions -----------------------------------------------------------------
    def prefill_time(self, instance: str, prompt_tokens: int, cached_tokens: int) -> float:
        t = self.prefill_base(instance, prompt_tokens, cached_tokens)
        if t is None:
            return self._fallback_prefill.prefill_time(instance, prompt_tokens, cached_tokens)
        return t * self.prefill_step(instance) / FACTOR_STEPS if self.online else t

    def prefill_step(self, instance: str) -> int:
        """The instance's prefill correction in steps of 1/FACTOR_STEPS: instances in the same
        step and deployment answer alike, so a decision still computes their terms once."""
        return round(self.ewma["prefill"].factor.get(instance, 1.0) * FACTOR_STEPS)

    def tbt(self, state: DecodeState, prompt_tokens: int, max_tokens: int) -> float:
        t = self.tbt_base(state, prompt_tokens, max_tokens)
        if t is None:
            return self._fallback_tbt.tbt(state, prompt_tokens, max_tokens)
        return t * self.ewma["tbt"].factor.get(self._compiled(state.instance).group_key, 1.0) if self.online else t

    def tbt_many(self, states: Sequence[DecodeState], prompt_tokens: int, max_tokens: int) -> list[float]:
        """:meth:`tbt` for every decode candidate of a decision in one call (64 of them at 64D):
        the same arithmetic in the same order, without three Python calls per candidate.
        tests/test_learned_tbt_many.py holds it equal to :meth:`tbt`: change both together."""
        inst, compiled = self._inst, self._compiled
        extra = (prompt_tokens if prompt_tokens > 0 else 0) + (max_tokens if max_tokens > 1 else 1)
        if max_tokens != self._share_of:
            self._share_of, self._share = max_tokens, slowest_share(max_tokens - 1 if max_tokens > 1 else 0)
        share, cluster = self._share, self.decode_cluster
        factor = self.ewma["tbt"].factor.get if self.online else None
        out: list[float] = []
        for state in states:
            c = inst.get(state.instance)
            if c is None:
                c = compiled(state.instance)
            k = c.tbt
            if k is None:  # no model: the warning and the analytic fallback, as tbt() gives them
                out.append(self.tbt(state, prompt_tokens, max_tokens))
                continue
            kv = (state.kv_tokens if state.kv_tokens > 0 else 0) + extra
            batch = (state.running if state.running > 0 else 0) + 1
            if kv > c.kv_capacity_tokens:
                batch, kv = resident_share(batch, kv, c.kv_capacity_tokens,
                                           state.kv_share if c.tbt_kv_share else 1.0)
            t = k[0] + k[1] * kv + k[2] * batch + k[3] * share + k[4] * cluster
            out.append(t if factor is None else t * factor(c.group_key, 1.0))
        return out

    def _tbt(self, state: DecodeState, prompt_tokens: int, max_tokens: int, cluster: float | None) -> float:
        """:meth:`tbt` for a record: with the cluster's decode load it was decided with."""
        t = self.tbt_base(state, prompt_tokens, max_tokens, cluster)
        if t is None:
            return self._fallback_tbt.tbt(state, prompt_tokens, max_tokens)
        return t * self.ewma["tbt"].factor.get(self._compiled(state.instance).group_key, 1.0) if self.online else t

    def transfer_time(self, tokens: int, source: str, destination: str) -> float:
        if tokens <= 0 or source == destination:
            return 0.0
        t = self.transfer_base(tokens, source, destination)
        if t is None:
            return self._fallback_transfer.transfer_time(tokens, source, destination)
        if not self.online:
            return t
        term = str(source) if source == Tier.STORE or source == Tier.HOST else "transfer"
        return t * self.ewma[term].factor.get(self._compiled(destination).group_key, 1.0)

    # --- online quantile tracking of the p90 (predictors/online_quantile.py) ---------------
    def p90(self, term: str, key: str, calibrated: float) -> float:
        """The served p90 of ``term`` (prefill, tbt, handover, ttft): the calibrated quantile times
        its tracker's scale for ``key`` (the instance's :attr:`CompiledTerms.group_key`; ttft: "all")."""
        return calibrated * self.quantiles[term].get(key) if self.online else calibrated

    def _upper(self, term: str, instance: str, x: Sequence[float]) -> float | None:
        """The model's calibrated upper quantile at features ``x`` (None: no model answers)."""
        m = self.model(term, instance)[0]
        return None if m is None else m.upper(x)

    # --- online correction: each term from observations of that term ----------------------
    def correction_key(self, term: str, instance: str) -> str:
        """Prefill is corrected per instance (its observations, lone prefills, do not depend on
        load). TBT and the KV shipment are corrected per deployment group: a request's TBT is
        observed a whole decode later and depends on who joined its batch since, so a
        per-instance factor makes an instance that happened to look fast attract the next
        requests until its TBT misses (measured: 97.2% -> 86.5% attainment at a 25 ms TBT SLO)."""
        return instance if term == "prefill" else self._compiled(instance).group_key

    def observe(self, rec: RequestRecord) -> None:
        """A finished request's record: corrections and p90 tracking (predictors/learned_online.py)."""
        learned_online.observe(self, rec)

    # --- what /admin/predictors shows ------------------------------------------------------
    def status(self, instances: Sequence[str] = ()) -> dict[str, Any]:
        return learned_online.status(self, instances)


class _AnalyticPrefillNoMemo:
    """The analytic prefill as the learned bundle's fallback (the bundle memoises itself)."""

    def __init__(self, book: DeploymentBook):
        self.book = book

    def prefill_time(self, instance: str, prompt_tokens: int, cached_tokens: int) -> float:
        from predictors.analytic import roofline_prefill_s
        return roofline_prefill_s(self.book.roofline(instance), int(prompt_tokens), int(cached_tokens))


@dataclass
class LearnedPredictors(Predictors):
    """The scheduler's bundle over a :class:`LearnedBundle` (``bundle`` for reload and status)."""

    bundle: LearnedBundle | None = None
    watch: str | None = None  # the directory whose models.json is reloaded when it changes
    _seen: float | None = None  # mtime of the last models.json tried (served or refused)

    def reload(self, directory: str) -> LearnedModels:
        """Validate ``DIR/models.json`` and only then serve it; :class:`ModelError` keeps the old."""
        assert self.bundle is not None
        seen = _mtime(directory)
        models = load_models(directory)
        self.bundle.swap(models, os.path.abspath(directory))
        self.watch, self._seen = directory, seen  # a refused directory changes neither
        return models

    def reload_if_changed(self) -> bool:
        """Reload the watched directory's models.json if it changed since it was last tried (the
        gateway calls this every health poll); a broken new file is logged once and refused."""
        if self.watch is None:
            return False
        m = _mtime(self.watch)
        if m is None or m == self._seen:
            return False
        try:
            self.reload(self.watch)
        except ModelError as e:
            self._seen = m  # refused once, not at every poll
            log.warning("learned predictors: changed model file refused, previous models keep serving: %s", e)
            return False
        log.info("learned predictors: reloaded %s (file changed)", self.watch)
        return True


def _mtime(directory: str) -> float | None:
    try:
        return os.stat(os.path.join(directory, MODELS_FILE)).st_mtime_ns / 1e9
    except OSError:
        return None


def learned_predictors(model_dir: str | None = None, *, models: LearnedModels | None = None,
                       prior: Prior | None = None, online: bool = True, alpha: float = 0.05,
                       strict: bool = True, quantile_eta: float | None = None) -> LearnedPredictors:
    """The learned bundle from ``model_dir`` (or ``models``); ``strict`` False serves the analytic
    prior for every term when the directory holds no valid model (logged) instead of raising."""
    source = ""
    if models is None and model_dir is not None:
        try:
            models = load_models(model_dir)
            source = os.path.abspath(model_dir)
        except ModelError as e:
            if strict:
                raise
            log.warning("learned predictors: %s; every term answered by the analytic prior", e)
    book = DeploymentBook(prior=Prior() if prior is None else prior)
    b = LearnedBundle(models, book, online=online, alpha=alpha, source=source, quantile_eta=quantile_eta)
    # online: instances alike in deployment and prefill correction share a group (computed once per decision)
    group: Callable[[str], Hashable] = b.group if online else (lambda i: book.keyed(i)[0])
    p = LearnedPredictors(queue=AnalyticQueue(), prefill=b, transfer=b, tbt=b, group=group, register=b.register,
                          unregister=b.unregister, groups=b.groups if online else None,
                          decode_load=b.set_decode_load, bundle=b, watch=model_dir)
    p._seen = None if model_dir is None else _mtime(model_dir)
    return p
