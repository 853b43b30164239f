"""``/admin/predictors``: which model answers each term and its live error; ``POST
/admin/predictors/reload``: swap in recalibrated models, validated first (a broken file is
refused with 400 and the models in service keep serving)."""
from __future__ import annotations

import json
import logging

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.config import GatewayConfig
from gateway.errors import error_response
from predictors.learned import LearnedPredictors, ModelError
from scheduler import Scheduler

log = logging.getLogger("conductor")


def status(cfg: GatewayConfig, sched: Scheduler) -> dict:
    pred = sched.predictors
    instances = [row["id"] for row in sched.snapshot()["instances"]]
    if isinstance(pred, LearnedPredictors) and pred.bundle is not None:
        out = pred.bundle.status(instances)
        out["configured"] = cfg.predictor_models
        return out
    return {"predictors": "analytic", "prior": {k: getattr(cfg.prior, k) for k in cfg.prior.field_names()},
            "terms": {t: {"answered_by": "analytic"} for t in ("queue", "prefill", "transfer", "tbt")}}


async def reload(cfg: GatewayConfig, sched: Scheduler, request: Request) -> Response:
    pred = sched.predictors
    if not isinstance(pred, LearnedPredictors):
        return error_response(409, "the gateway serves analytic predictors; set predictors = \"learned\" and "
                                   "predictor_models in its config", "predictors_not_learned")
    directory = cfg.predictor_models
    body = await request.body()
    if body.strip():
        try:
            raw = json.loads(body)
        except json.JSONDecodeError:
            return error_response(400, "body must be JSON ({\"path\": DIR}) or empty", "invalid_json")
        if not isinstance(raw, dict) or not isinstance(raw.get("path", directory), str):
            return error_response(400, "path must be a directory name", "invalid_parameter", "path")
        directory = raw.get("path", directory)
    if not directory:
        return error_response(400, "no model directory configured or given", "invalid_parameter", "path")
    try:
        models = pred.reload(directory)
    except ModelError as e:
        log.warning("predictor reload refused, previous models keep serving: %s", e)
        return error_response(400, f"models refused, previous ones keep serving: {e}", "invalid_models")
    log.info("predictors reloaded from %s (%s)", directory, ", ".join(models.terms))
    return JSONResponse({"reloaded": directory, "terms": sorted(models.terms), "status": status(cfg, sched)})
