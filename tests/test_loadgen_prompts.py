"""Prompt synthesis reproduces a trace's prefix sharing exactly under the built-in tokenizer."""
from itertools import combinations

import pytest

from engines_adapters.tokenizer import ByteTokenizer
from loadgen.prompts import ChatFraming, PromptSynth, build_body, build_prompt
from loadgen.workload import Request, read_mooncake
from scheduler.hashing import block_hashes
from tests.traces import MOONCAKE

tok = ByteTokenizer()


@pytest.fixture(scope="module")
def trace():
    return read_mooncake(str(MOONCAKE), limit=300).requests


def tokens(req: Request, synth: PromptSynth, endpoint: str, fmt: str = "text") -> list[int]:
    p = build_prompt(req, synth, endpoint, fmt)
    if endpoint == "chat":
        return tok.encode_chat(p.fields["messages"])
    return tok.encode_prompt(p.fields["prompt"])


@pytest.mark.parametrize("endpoint,fmt", [("chat", "text"), ("completions", "text"), ("completions", "token-ids")])
def test_lengths_exact_and_equal_ids_equal_blocks(trace, endpoint, fmt):
    synth = PromptSynth()
    seen: dict[int, tuple] = {}  # hash id -> its block's tokens
    owner: dict[tuple, int] = {}  # block tokens -> hash id
    slack = len(ChatFraming.of().trailer) - 1 if endpoint == "chat" else 0
    for r in trace:
        t = tokens(r, synth, endpoint, fmt)
        assert len(t) == build_prompt(r, synth, endpoint, fmt).tokens
        # exact, except a chat trailer longer than the partial last block replaces that block
        assert r.input_length <= len(t) <= r.input_length + (slack if r.input_length % 512 < slack + 1 else 0)
        for k, h in enumerate(r.hash_ids):
            if (k + 1) * 512 > r.input_length:  # every complete block is checked, the last one too
                break
            block = tuple(t[k * 512:(k + 1) * 512])
            assert seen.setdefault(h, block) == block, f"id {h} gave two different blocks"
            assert owner.setdefault(block, h) == h, f"ids {owner[block]} and {h} gave the same block"
    assert len(seen) > 1000


def test_engine_prefix_cache_sees_exactly_the_shared_blocks(trace):
    """A 16-token-block engine shares 32 blocks per shared 512-token trace block, no more."""
    synth = PromptSynth()
    reqs = trace[:120]
    hashes = {r.index: block_hashes(tokens(r, synth, "chat"), 16) for r in reqs}
    checked = 0
    for a, b in combinations(reqs, 2):
        m = next((k for k, (x, y) in enumerate(zip(a.hash_ids, b.hash_ids, strict=False)) if x != y), None)
        if m is None:
            continue  # one id list is a prefix of the other: not a divergence
        ha, hb = hashes[a.index], hashes[b.index]
        common = next((k for k, (x, y) in enumerate(zip(ha, hb, strict=False)) if x != y), min(len(ha), len(hb)))
        assert common == 32 * m, (a.index, b.index, m)
        checked += 1
    assert checked > 5000


def test_partial_block_is_a_prefix_and_ids_never_collide():
    synth = PromptSynth()
    assert synth.text((3, 9), 700) == synth.block_text(3) + synth.block_text(9)[:188]
    blocks = {synth.block_text(h)[:8] for h in range(5000)}
    assert len(blocks) == 5000  # the id header alone tells any two blocks apart
    assert all(len(synth.block_text(h)) == 512 and synth.block_text(h).isascii() for h in (0, 1, 10**9))
    with pytest.raises(ValueError):
        synth.text((1,), 513)


def test_salt_changes_text_but_not_sharing():
    a, b = PromptSynth(salt="step0"), PromptSynth(salt="step1")
    assert a.block_text(5) != b.block_text(5)
    assert a.block_text(5) == PromptSynth(salt="step0").block_text(5)  # deterministic
    r1 = Request(0, 0.0, 1100, 4, (0, 1, 2))
    r2 = Request(1, 0.0, 1100, 4, (0, 1, 7))
    for s in (a, b):
        t1, t2 = s.text(r1.hash_ids, 1100), s.text(r2.hash_ids, 1100)
        assert t1[:1024] == t2[:1024] and t1[1024] != t2[1024]


def test_chat_framing_of_the_builtin_template():
    f = ChatFraming.of()
    assert (f.header, f.trailer) == ("<|user|>\n", "\n<|assistant|>\n")


def test_short_prompt_reports_its_real_length():
    r = Request(0, 0.0, 10, 4, (0,))
    p = build_prompt(r, PromptSynth(), "chat")
    assert p.tokens == len(tok.encode_chat(p.fields["messages"])) == 25
    assert build_prompt(r, PromptSynth(), "completions").tokens == 10


def test_body_forces_output_length():
    r = Request(0, 0.0, 600, 37, (0, 1))
    body, n = build_body(r, PromptSynth(), model="m", endpoint="completions", prompt_format="token-ids")
    assert n == 600 and len(body["prompt"]) == 600 and all(32 <= t < 127 for t in body["prompt"])
    assert body["max_tokens"] == 37 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["model"] == "m"
    with pytest.raises(ValueError):
        build_body(r, PromptSynth(), model="m", endpoint="chat", prompt_format="token-ids")


@pytest.mark.parametrize("n", [1029, 1024, 1038])
def test_chat_trailer_never_changes_a_complete_block(n):
    """A short (or no) partial block: the trailer must not reach back into block 1, which a
    longer request with the same first ids shares."""
    synth = PromptSynth()
    short = Request(index=0, arrival_s=0.0, input_length=n, output_length=1, hash_ids=(0, 1, 2))
    long = Request(index=1, arrival_s=0.0, input_length=2048, output_length=1, hash_ids=(0, 1, 3, 4))
    a, b = tokens(short, synth, "chat"), tokens(long, synth, "chat")
    assert a[:1024] == b[:1024]
    assert block_hashes(a, 16)[:64] == block_hashes(b, 16)[:64]
