"""Store master config (flags, env, validation) and the persister's retry rule (no network)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from services.common.config import ConfigError, load_config
from services.store_master.core import Changes, MasterParams, StoreMaster
from services.store_master.main import StoreMasterConfig
from services.store_master.persist import Persister, hash_names


def test_defaults_follow_mooncake() -> None:
    cfg = load_config(StoreMasterConfig, [], {})
    assert cfg.params() == MasterParams()
    p = cfg.params()
    assert (p.lease_ttl_s, p.soft_pin_ttl_s, p.client_ttl_s) == (10.0, 1800.0, 10.0)
    assert (p.high_watermark, p.eviction_ratio) == (0.90, 0.05)
    assert cfg.allocation_strategy == "random" and cfg.eviction_policy == "sampled_lru"
    assert not cfg.persist_to_redis()


def test_flags_and_env() -> None:
    env = {"KVMESH_READ_LEASE_TTL_S": "2.5", "KVMESH_ALLOCATION_STRATEGY": "free_ratio_first",
           "KVMESH_REDIS_URL": "redis://127.0.0.1:1"}
    cfg = load_config(StoreMasterConfig, ["--high-watermark", "0.8"], env)
    assert cfg.params().lease_ttl_s == 2.5 and cfg.params().high_watermark == 0.8
    assert cfg.allocation_strategy == "free_ratio_first" and cfg.persist_to_redis()
    cfg = load_config(StoreMasterConfig, ["--persist", "none"], env)
    assert not cfg.persist_to_redis()


@pytest.mark.parametrize("argv,problem", [
    (["--high-watermark", "1.2"], "high_watermark"),
    (["--eviction-ratio", "0"], "eviction_ratio"),
    (["--read-lease-ttl-s", "0"], "lease_ttl_s"),
    (["--allocation-strategy", "best"], "allocation_strategy"),
    (["--eviction-policy", "fifo"], "eviction_policy"),
    (["--eviction-sample", "0"], "eviction_sample"),
    (["--tick-interval-s", "0"], "tick_interval_s"),
    (["--persist", "disk"], "persist"),
    (["--persist", "redis"], "needs --redis-url"),
])
def test_bad_values_are_rejected(argv: list[str], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        load_config(StoreMasterConfig, argv, {})


def test_hash_names_are_per_namespace() -> None:
    assert hash_names("a") == ("kvmesh:a:store:segments", "kvmesh:a:store:objects")


class FlakyStore:
    def __init__(self) -> None:
        self.down = True
        self.writes: list[Changes] = []

    async def write(self, changes: Changes) -> int:
        if self.down:
            raise RedisConnectionError("down")
        self.writes.append(changes)
        return len(changes.objects) + len(changes.segments)


async def test_failed_flush_keeps_changes_and_retries() -> None:
    t = [0.0]
    m = StoreMaster(lambda: t[0], random.Random(0))
    store: Any = FlakyStore()
    p = Persister(m, store)
    m.mount_segment("c", "s", 0, 100)
    m.put_start("k", 10)
    assert not await p.flush() and p.failures == 1
    m.put_end("k")
    m.put_start("gone", 10)
    m.put_revoke("gone")
    store.down = False
    assert await p.flush()
    (written,) = store.writes
    assert set(written.segments) == {"s"} and written.objects["gone"] is None
    assert written.objects["k"]["completed_at"] == 0.0  # the newest record won
    assert p.records_written == 3
    assert await p.flush() and len(store.writes) == 1  # nothing pending, nothing written


async def test_persister_without_store_only_drains() -> None:
    m = StoreMaster(lambda: 0.0, random.Random(0))
    p = Persister(m, None)
    m.mount_segment("c", "s", 0, 100)
    assert await p.flush() and not p.enabled and not m.drain_changes()
