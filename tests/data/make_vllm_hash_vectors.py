"""Writes vllm_hash_vectors.json: golden prefix-cache block hashes by vLLM's recipe.

Independent of the project's code on purpose (it imports nothing of ours): it restates the
recipe read from vLLM's source with the libraries vLLM itself calls, so a slip in
scheduler/hashing.py cannot also slip in here.

- vllm/utils/hashing.py: sha256 = hashlib.sha256(pickle.dumps(obj, HIGHEST_PROTOCOL)),
  sha256_cbor = hashlib.sha256(cbor2.dumps(obj, canonical=True)),
  xxhash = xxhash.xxh3_128_digest(pickle...), xxhash_cbor = xxhash.xxh3_128_digest(cbor2...).
- vllm/v1/core/kv_cache_utils.py: NONE_HASH = hash_fn(seed), seed = PYTHONHASHSEED whenever it is
  set (the empty string too), else "vllm-none-hash" (sha256 algos; xxhash ones draw a random seed);
  block i = hash_fn((parent or NONE_HASH, tuple(block_tokens), extra_keys)); extra_keys =
  tuple([lora_name] + ([cache_salt] on the first block only)) or None; the KV-event int is
  int.from_bytes(digest, "big") & (2**64 - 1).

Run: python tests/data/make_vllm_hash_vectors.py  (Python >= 3.8, cbor2, xxhash)
"""
import hashlib
import importlib.metadata
import json
import pickle
import sys
from pathlib import Path

import cbor2
import xxhash

ALGOS = {
    "sha256": lambda o: hashlib.sha256(pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL)).digest(),
    "sha256_cbor": lambda o: hashlib.sha256(cbor2.dumps(o, canonical=True)).digest(),
    "xxhash": lambda o: xxhash.xxh3_128_digest(pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL)),
    "xxhash_cbor": lambda o: xxhash.xxh3_128_digest(cbor2.dumps(o, canonical=True)),
}
UNSET = None  # PYTHONHASHSEED not in the environment

CASES = [
    # (name, tokens, block_size, lora_name, cache_salt)
    ("plain-1..8-bs4", list(range(1, 9)), 4, None, None),
    ("plain-40tok-bs16", [(i * 7919) % 50000 for i in range(40)], 16, None, None),
    ("salt-1..8-bs4", list(range(1, 9)), 4, None, "tenant-a"),
    ("salt-b-1..8-bs4", list(range(1, 9)), 4, None, "tenant-b"),
    ("lora-1..8-bs4", list(range(1, 9)), 4, "sql-lora", None),
    ("lora+salt-1..8-bs4", list(range(1, 12)), 4, "sql-lora", "tenant-a"),
]


def extra_keys(first, lora_name, cache_salt):
    keys = ([lora_name] if lora_name else []) + ([cache_salt] if first and cache_salt else [])
    return tuple(keys) if keys else None


def chain(fn, none_hash, tokens, bs, lora_name, cache_salt):
    prev, out = none_hash, []
    for i in range(len(tokens) // bs):
        prev = fn((prev, tuple(tokens[i * bs:(i + 1) * bs]), extra_keys(i == 0, lora_name, cache_salt)))
        out.append(prev)
    return out


def main():
    vectors = []
    for algo, fn in ALGOS.items():
        seeds = ["0", ""] + ([UNSET] if algo.startswith("sha256") else [])
        for seed in seeds:
            none_hash = fn("vllm-none-hash" if seed is UNSET else seed)
            for name, tokens, bs, lora, salt in CASES:
                digests = chain(fn, none_hash, tokens, bs, lora, salt)
                vectors.append({
                    "algo": algo, "pythonhashseed": seed, "case": name, "tokens": tokens, "block_size": bs,
                    "lora_name": lora, "cache_salt": salt, "none_hash": none_hash.hex(),
                    "digests": [d.hex() for d in digests],
                    "event_ints": [int.from_bytes(d, "big") & (2**64 - 1) for d in digests],
                })
    out = {"produced_by": "tests/data/make_vllm_hash_vectors.py",
           "python": sys.version.split()[0], "cbor2": importlib.metadata.version("cbor2"),
           "xxhash": xxhash.VERSION, "vectors": vectors}
    path = Path(__file__).with_name("vllm_hash_vectors.json")
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{len(vectors)} vectors -> {path}")


if __name__ == "__main__":
    main()
