"""Store keys in the engines' own formats, and a memo that makes them cheap per request.

Two recipes (read from the engines' sources; see docs/store.md and docs/protocols.md):

* ``vllm``: vLLM's MooncakeStoreConnector ``PoolKey``, one object per KV block (rank 0, no
  prefix): ``{model}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{block digest hex}``, the digest being
  vLLM's prefix-caching chain (sha256 over pickle by default);
* ``sglang``: SGLang HiCache on Mooncake, one object pair per page (MHA, tp rank 0):
  ``{model with / -> -}_{page hash hex}_0_k`` and ``..._0_v``, the page hash being SGLang's
  SHA-256 chain over the page's tokens as u32 little-endian.

Namespaces (a request's ``cache_salt`` and LoRA adapter) enter the digests exactly as the engine's
own chain takes them, so two tenants never share a store object and one tenant's repeat does:
vLLM's extra keys (the adapter's name on every block, the salt on the request's first block;
docs/protocols.md §3), SGLang's namespace seed ``SHA256("sglang-cache-namespace-v1" || parts)``
that the first page chains from (parts: the extra key, here the adapter, then the salt; each
``0x00`` when absent, else ``0x01``, its UTF-8 length as u64 LE, the bytes).

A router and an engine both need "the keys of this prompt's blocks". Computing a SHA-256 chain per
request costs microseconds per block; prompts share prefixes, so :class:`KeyBook` remembers each
block's digest by our own index hash (``scheduler.hashing.block_hashes``, already computed per
request) and only hashes the blocks it has not seen.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Container, Sequence

from engines_adapters.sglang_wire import page_digests as sglang_page_digests  # SGLang's page chain, one copy
from scheduler.hashing import vllm_block_digests, vllm_none_hash

RECIPES = ("vllm", "sglang")

#: A request's prefix-cache namespace: (cache_salt, lora adapter name), or None for the base one.
Namespace = tuple[str | None, str | None] | None


_SGLANG_NS = b"sglang-cache-namespace-v1"


def sglang_namespace_seed(extra_key: str | None, cache_salt: str | None) -> bytes | None:
    """The digest a namespaced request's first page chains from in SGLang's storage keys (None:
    no namespace, the first page has no prior)."""
    if not extra_key and not cache_salt:
        return None
    h = hashlib.sha256(_SGLANG_NS)
    for part in (extra_key, cache_salt):
        if not part:
            h.update(b"\x00")
        else:
            raw = part.encode("utf-8", "surrogatepass")
            h.update(b"\x01" + len(raw).to_bytes(8, "little") + raw)
    return h.digest()


class KeyRecipe:
    """One engine's store-key recipe: digests per block, and the object keys of a block."""

    def __init__(self, recipe: str, model: str, block_size: int, seed_text: str | None = None,
                 algo: str = "sha256"):
        """``seed_text``: vLLM's PYTHONHASHSEED, which seeds its chain (default: this process's);
        ``algo``: vLLM's ``--prefix-caching-hash-algo``."""
        self.algo = algo
        if recipe not in RECIPES:
            raise ValueError(f"unknown store key recipe {recipe!r}; expected one of {', '.join(RECIPES)}")
        self.recipe, self.model, self.block_size = recipe, model, block_size
        if recipe == "vllm":
            self._prefix = f"{model.rstrip('/').rsplit('/', 1)[-1]}@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@"
            self.root: bytes | None = vllm_none_hash(seed_text, algo)
        else:
            self._prefix = f"{model.replace('/', '-')}_"
            self.root = None

    def digests(self, tokens: Sequence[int], parent: bytes | None, ns: Namespace = None) -> list[bytes]:
        """Digests of ``tokens``' blocks chained from ``parent`` (None: the request's first block);
        ``ns``: the request's (cache salt, LoRA adapter), or None."""
        salt, lora = ns or (None, None)
        if self.recipe == "vllm":
            return vllm_block_digests(tokens, self.block_size, parent=parent if parent is not None else self.root,
                                      algo=self.algo, lora_name=lora, cache_salt=salt, first=parent is None)
        if parent is None and (salt or lora):
            parent = sglang_namespace_seed(lora, salt)
        return sglang_page_digests(tokens, self.block_size, parent)

    def key(self, digest: bytes) -> str:
        """The object key a prefix check asks about (SGLang: the page's K object)."""
        if self.recipe == "vllm":
            return self._prefix + digest.hex()
        return f"{self._prefix}{digest.hex()}_0_k"

    def object_keys(self, digest: bytes) -> list[str]:
        """Every object one block is written as."""
        if self.recipe == "vllm":
            return [self._prefix + digest.hex()]
        base = f"{self._prefix}{digest.hex()}_0"
        return [base + "_k", base + "_v"]

    def digest_of(self, key: str) -> bytes | None:
        """The block digest a key names (None for a key of another recipe or model)."""
        if not key.startswith(self._prefix):
            return None
        rest = key[len(self._prefix):]
        if self.recipe == "sglang":
            if not rest.endswith(("_0_k", "_0_v")):
                return None
            rest = rest[:-4]
        try:
            d = bytes.fromhex(rest)
        except ValueError:
            return None
        return d if len(d) in (16, 32) else None  # sha256 recipes, or vLLM's xxhash (XXH3-128) ones


class KeyBook:
    """Engine store keys of a prompt's blocks, memoised by our index hash (bounded LRU)."""

    def __init__(self, recipe: KeyRecipe, max_entries: int = 1 << 20,
                 on_learn: Callable[[list[bytes]], None] | None = None,
                 on_forget: Callable[[bytes], bool] | None = None):
        """``on_learn``: told the digests the memo gains; ``on_forget``: asked about each digest the
        bounded memo is about to drop, oldest first: True keeps it (as the newest)."""
        self.recipe = recipe
        self.max_entries = max_entries
        self.on_learn, self.on_forget = on_learn, on_forget
        self._memo: OrderedDict[int, bytes] = OrderedDict()  # index hash -> engine block digest
        self.hashed = 0  # blocks hashed (memo misses)

    def _trim(self) -> None:
        memo, forget = self._memo, self.on_forget
        budget = 4 * (len(memo) - self.max_entries) + 16  # kept entries per trim: bounded work
        while len(memo) > self.max_entries:
            h, d = memo.popitem(last=False)
            if forget is not None and budget > 0 and forget(d):
                memo[h] = d  # kept: the newest now
                budget -= 1

    def digests(self, tokens: Sequence[int], index_hashes: Sequence[int], limit: int | None = None,
                ns: Namespace = None) -> list[bytes]:
        """Engine digests of the first ``limit`` blocks (default all ``index_hashes``); the memo
        is keyed by index hashes, which already differ per namespace (``ns``)."""
        n = len(index_hashes) if limit is None else min(limit, len(index_hashes))
        memo = self._memo
        out: list[bytes] = []
        for h in index_hashes[:n]:  # the longest remembered prefix
            d = memo.get(h)
            if d is None:
                break
            out.append(d)
        if len(out) < n:
            bs = self.recipe.block_size
            start = len(out)
            fresh = self.recipe.digests(tokens[start * bs:n * bs], out[-1] if out else None, ns)
            self.hashed += len(fresh)
            for h, d in zip(index_hashes[start:n], fresh, strict=True):
                memo[h] = d
            if self.on_learn is not None:
                self.on_learn(fresh)
            out += fresh
            if len(memo) > self.max_entries:
                self._trim()
        return out

    def held_prefix(self, tokens: Sequence[int], index_hashes: Sequence[int], n: int, held: Container[bytes],
                    start: int = 0, ns: Namespace = None, hash_unknown: bool = True) -> int:
        """Leading blocks (of the first ``n``) whose digest is in ``held``, hashing lazily: a block
        not yet remembered is hashed only if every block before it is held, so a miss costs at
        most one SHA-256 (call :meth:`digests` later, off the hot path, to remember the rest).
        ``start``: blocks already known to be held (the walk begins there; the first chunk is
        then short: the block after a known prefix is usually new). ``hash_unknown=False``: the
        caller knows every held digest is remembered, so a block that is not cannot be held."""
        memo = self._memo
        n = min(n, len(index_hashes))
        k, step = start, 2 if start else 16
        mget, contains = memo.get, held.__contains__
        while k < n:  # remembered and held, chunk by growing chunk at C speed (a None is never held)
            chunk = list(map(mget, index_hashes[k:min(n, k + step)]))
            flags = list(map(contains, chunk))
            if not all(flags):
                j = flags.index(False)
                if chunk[j] is not None:
                    return k + j  # remembered and not held: the prefix ends here
                k += j
                break
            k += len(chunk)
            step *= 2
        if k >= n or not hash_unknown:
            return k
        parent = memo.get(index_hashes[k - 1]) if k else None
        if k and parent is None:  # (the memo dropped it: the chain again)
            parent = self.digests(tokens, index_hashes, k, ns)[-1]
        bs = self.recipe.block_size
        while k < n:
            d = self.recipe.digests(tokens[k * bs:(k + 1) * bs], parent, ns)[0]
            self.hashed += 1
            memo[index_hashes[k]] = d
            if self.on_learn is not None:
                self.on_learn([d])
            if d not in held:
                break
            parent, k = d, k + 1
        if len(memo) > self.max_entries:
            self._trim()
        return k

    def keys(self, tokens: Sequence[int], index_hashes: Sequence[int], limit: int | None = None,
             ns: Namespace = None) -> list[str]:
        key = self.recipe.key
        return [key(d) for d in self.digests(tokens, index_hashes, limit, ns)]
