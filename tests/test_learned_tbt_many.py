"""The learned TBT of all decode candidates in one call answers exactly what one call each does
(the scheduler uses the batched form; the per-candidate form is what the record and admission
ask): bit for bit, with and without the online correction, for instances with and without a
model, whatever max_tokens, the cluster's load and each instance's KV share."""
import random
from pathlib import Path

import pytest

from predictors.base import DecodeState
from predictors.facts import load_deployment
from predictors.learned import learned_predictors

RUN = str(Path(__file__).resolve().parents[1] / "docs/runs/learned-8b-gap-conversation")


@pytest.mark.parametrize("online", [True, False])
def test_tbt_many_equals_tbt_per_candidate(online):
    p = learned_predictors(RUN, online=online)
    bundle = p.tbt
    ids = [f"d{i}" for i in range(12)]
    for k, iid in enumerate(ids):  # two without a TBT model of their deployment: the analytic fallback
        p.register(iid, load_deployment("llama3-70b-a800x8" if k in (3, 7) else "llama3-8b-h200"), 300_000 + k)
    rng = random.Random(5)
    for i in ids[::3]:  # online corrections away from 1 for some groups
        bundle.ewma["tbt"].factor[bundle._compiled(i).group_key] = 0.8 + rng.random() * 0.4
    for _ in range(200):
        p.decode_load(rng.choice([0.0, rng.random() * 40]))  # type: ignore[misc]
        states = [DecodeState(i, rng.randrange(-1, 60), rng.randrange(-5, 2_000_000),
                              rng.choice([1.0, 0.0, rng.uniform(0.2, 1.0)])) for i in rng.sample(ids, 9)]
        prompt, max_tokens = rng.randrange(-1, 9000), rng.choice([0, 1, 2, rng.randrange(1, 2048)])
        many = bundle.tbt_many(states, prompt, max_tokens)
        assert many == [bundle.tbt(s, prompt, max_tokens) for s in states]
        assert many == [bundle.tbt(s, prompt, max_tokens) for s in states]  # and asking it did not move the others
    assert bundle.tbt_many([], 100, 10) == []
