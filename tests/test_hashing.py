from hypothesis import given, strategies as st

from scheduler.hashing import block_hashes, vllm_block_digests, vllm_block_hashes, vllm_none_hash

TOKENS = list(range(1, 9))


def test_vllm_sha256_golden_vectors():
    assert vllm_none_hash("0").hex().startswith("1973e238")
    assert vllm_none_hash("0").hex().endswith("4b14aa7c")
    assert vllm_block_hashes(TOKENS, 4, seed_text="0") == [10362225831949560093, 12472515041799373675]


def test_vllm_sha256_cbor_golden_vectors():
    root = vllm_none_hash("0", "sha256_cbor").hex()
    assert root.startswith("4e1195df") and root.endswith("2e61c3e")
    assert vllm_block_hashes(TOKENS, 4, seed_text="0", algo="sha256_cbor") == [
        2164874634404590027,
        17270480062156288726,
    ]


def test_vllm_seed_from_env(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert vllm_block_hashes(TOKENS, 4) == [10362225831949560093, 12472515041799373675]
    monkeypatch.delenv("PYTHONHASHSEED")
    assert vllm_block_hashes(TOKENS, 4) != [10362225831949560093, 12472515041799373675]


def test_partial_block_never_hashed():
    assert block_hashes(list(range(15)), 16) == []
    assert len(block_hashes(list(range(33)), 16)) == 2
    assert len(vllm_block_digests(list(range(7)), 4)) == 1


@given(st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=200), st.integers(1, 16))
def test_chain_names_whole_prefix(tokens, bs):
    h = block_hashes(tokens, bs)
    # a prefix's hashes are a prefix of the hashes
    k = len(tokens) // 2
    assert block_hashes(tokens[:k], bs) == h[: k // bs]
    # continuing a chain from a parent equals hashing the whole
    if len(h) >= 2:
        assert block_hashes(tokens[bs:], bs, parent=h[0]) == h[1:]


def test_chain_depends_on_earlier_blocks():
    a = block_hashes([1] * 16 + [2] * 16, 16)
    b = block_hashes([3] * 16 + [2] * 16, 16)
    assert a[1] != b[1]


# --- vLLM recipe against golden vectors computed independently (tests/data/make_vllm_hash_vectors.py) ---

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from scheduler.hashing import (  # noqa: E402
    event_chain_keys,
    namespace_parent,
    vllm_extra_keys,
    vllm_seed_text,
)

VECTORS = json.loads((Path(__file__).parent / "data" / "vllm_hash_vectors.json").read_text())["vectors"]


def _id(v):
    return f"{v['algo']}-seed={v['pythonhashseed']!r}-{v['case']}"


@pytest.mark.parametrize("v", VECTORS, ids=_id)
def test_vllm_recipe_matches_golden_vectors(v, monkeypatch):
    """Every algo, seed (set, set-but-empty, unset) and extra-key case, seeded the way vLLM reads
    PYTHONHASHSEED from its environment."""
    if v["pythonhashseed"] is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", v["pythonhashseed"])
    assert vllm_none_hash(algo=v["algo"]).hex() == v["none_hash"]
    kw = {"algo": v["algo"], "lora_name": v["lora_name"], "cache_salt": v["cache_salt"]}
    assert [d.hex() for d in vllm_block_digests(v["tokens"], v["block_size"], **kw)] == v["digests"]
    assert vllm_block_hashes(v["tokens"], v["block_size"], **kw) == v["event_ints"]


def test_empty_pythonhashseed_is_a_seed_not_unset(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "")
    assert vllm_seed_text() == ""
    assert vllm_none_hash() == vllm_none_hash("") != vllm_none_hash("vllm-none-hash")
    monkeypatch.delenv("PYTHONHASHSEED")
    assert vllm_seed_text() == "vllm-none-hash"


def test_xxhash_with_unset_seed_is_refused_not_guessed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    for algo in ("xxhash", "xxhash_cbor"):
        with pytest.raises(ValueError, match="PYTHONHASHSEED"):
            vllm_none_hash(algo=algo)
        assert len(vllm_none_hash("0", algo)) == 16  # XXH3-128
    with pytest.raises(ValueError, match="unknown prefix-caching hash algo"):
        vllm_none_hash("0", "md5")


def test_vllm_extra_keys_salt_first_block_lora_every_block():
    assert vllm_extra_keys(True) is None and vllm_extra_keys(True, cache_salt="") is None
    assert vllm_extra_keys(True, cache_salt="s") == ("s",) and vllm_extra_keys(False, cache_salt="s") is None
    assert vllm_extra_keys(True, "a", "s") == ("a", "s") and vllm_extra_keys(False, "a", "s") == ("a",)
    # a salted chain differs from block 0 on; continuing it from a parent adds no salt again
    plain = vllm_block_digests(TOKENS, 4, seed_text="0")
    salted = vllm_block_digests(TOKENS, 4, seed_text="0", cache_salt="s")
    assert all(a != b for a, b in zip(plain, salted, strict=True))
    assert vllm_block_digests(TOKENS[4:], 4, seed_text="0", cache_salt="s", parent=salted[0]) == salted[1:]


def test_namespace_root_of_the_index():
    assert namespace_parent() is None and namespace_parent("", None) is None  # unsalted: hashing untouched
    roots = {namespace_parent("a"), namespace_parent("b"), namespace_parent(None, "a"), namespace_parent("a", "a")}
    assert None not in roots and len(roots) == 4  # a salt never aliases an adapter of the same name
    assert block_hashes(TOKENS, 4, parent=namespace_parent("a")) != block_hashes(TOKENS, 4)


@pytest.mark.parametrize("keys0, keys1", [
    (["sql-lora", "tenant-a"], ["sql-lora"]),  # vLLM: untagged lora name, then the salt
    ([["lora", "sql-lora", "/a"], ["cache_salt", "tenant-a"]], [["lora", "sql-lora", "/a"]]),  # domain-tagged
])
def test_event_chain_keys_read_salt_and_adapter(keys0, keys1):
    """The index's root for an event's chain equals the gateway's for the same salt and adapter."""
    parent, keys = event_chain_keys([keys0, keys1], 2, "sql-lora", root=True)
    assert parent == namespace_parent("tenant-a", "sql-lora") and keys is None
    assert event_chain_keys([None, None], 2, None, root=True) == (None, None)
    assert event_chain_keys([["s"]], 1, None, root=True)[0] == namespace_parent("s")
    # mid-chain: no salt, the adapter is carried by the parent; opaque (multimodal) keys get a seed key
    assert event_chain_keys([["sql-lora"], ["sql-lora"]], 2, "sql-lora", root=False) == (None, None)
    parent, keys = event_chain_keys([None, [["mm-hash", 3]]], 2, None, root=False)
    assert parent is None and keys is not None and keys[0] == 0 and keys[1] != 0
