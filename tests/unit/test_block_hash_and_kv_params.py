import struct

import pytest
import xxhash

from protos import worker_pb2
from services.common.block_hash import block_hashes, local_block_hash
from services.common.kv_params import from_dict, is_set, to_dict


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


def test_kv_params_round_trip() -> None:
    d = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e1",
         "remote_request_id": "r", "remote_block_ids": [3, 4], "remote_host": "127.0.0.1",
         "remote_port": 5600, "tp_size": 1, "transfer_mode": "push",
         "future_key": {"x": [1, 2]}}
    msg = from_dict(d)
    assert msg.extra["future_key"] == '{"x": [1, 2]}'
    assert to_dict(worker_pb2.KvTransferParams.FromString(msg.SerializeToString())) == d
    assert not is_set(from_dict(None)) and is_set(msg)
    assert to_dict(from_dict({"remote_host": None, "do_remote_decode": True})) == {
        "do_remote_prefill": False, "do_remote_decode": True}
