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
