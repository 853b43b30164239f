"""Deterministic output text and output lengths for the simulated engine.

Output token ids are bytes of a seeded stream of English words (printable ASCII), so
``ByteTokenizer.decode`` of a response gives readable text. Each request reads the stream from
an offset derived from (engine seed, request id): reproducible whatever the arrival order, and
no per-token Python work in the engine loop (a token is one indexing operation).

Without ``ignore_eos`` a request's output length is drawn from a log-normal distribution
(median ``median_output``, sigma 0.8), again keyed by (seed, request id), and capped by
``max_tokens``; the request then ends with ``finish_reason`` "stop" (else "length").
"""
from __future__ import annotations

import math
import random

import xxhash

WORDS = (
    "the a of to and in is that for on with as it by at from this be are or an was which we can "
    "cache token block prefix decode prefill model request batch memory time engine stream "
    "scheduler transfer latency throughput kernel layer attention value key query node instance "
    "moon cake conductor simple small large fast slow first next last good new long short data "
    "text word line page result answer question reason plan step work load state queue"
).split()

CORPUS_BYTES = 1 << 16


def make_corpus(seed: int, size: int = CORPUS_BYTES) -> bytes:
    """A seeded stream of words with sentence punctuation, ``size`` bytes of printable ASCII."""
    rng = random.Random(seed)
    out: list[str] = []
    n = 0
    capital = True
    while n < size:
        w = rng.choice(WORDS)
        if capital:
            w = w.capitalize()
            capital = False
        r = rng.random()
        if r < 0.08:
            w += "."
            capital = True
        elif r < 0.14:
            w += ","
        out.append(w)
        n += len(w) + 1
    return " ".join(out).encode("ascii")[:size]


class OutputSampler:
    """Per-request output offsets and lengths, keyed by (seed, request id)."""

    def __init__(self, seed: int, median_output: int = 128, sigma: float = 0.8):
        self.seed = seed
        self.corpus = make_corpus(seed)
        self._mu = math.log(max(1, median_output))
        self._sigma = sigma

    def draw(self, request_id: str) -> tuple[int, int]:
        """(corpus offset, natural output length) of a request."""
        h = xxhash.xxh3_64_intdigest(request_id.encode(), self.seed & 0xFFFFFFFFFFFFFFFF)
        rng = random.Random(h)
        length = max(1, int(round(rng.lognormvariate(self._mu, self._sigma))))
        return h % len(self.corpus), length

    def tokens(self, offset: int, start: int, end: int) -> list[int]:
        """Output token ids ``start..end`` of a request reading from ``offset``."""
        c = self.corpus
        n = len(c)
        out: list[int] = []
        i = start
        while i < end:
            j = (offset + i) % n
            take = min(end - i, n - j)
            out.extend(c[j : j + take])
            i += take
        return out
