"""services.frontend.responses_store: bounded by count, bytes and TTL (an injected clock),
LRU eviction, tenant isolation, and the conversation a previous_response_id continues."""

from __future__ import annotations

from typing import Any

import pytest

from services.frontend.responses_store import (
    ResponseStore,
    continue_messages,
    conversation,
    entry_size,
)

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def resp(rid: str, text: str = "hello", calls: list[dict[str, Any]] | None = None
         ) -> dict[str, Any]:
    output: list[dict[str, Any]] = [
        {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": text, "annotations": []}]}] if text else []
    output += calls or []
    return {"id": rid, "object": "response", "status": "completed", "output": output}


def store(clock: Clock, entries: int = 10, max_bytes: int = 1 << 20,
          ttl: float = 60.0) -> ResponseStore:
    return ResponseStore(entries, max_bytes, ttl, clock)


def test_put_get_delete_and_sizes() -> None:
    s = store(Clock())
    assert s.put("t", resp("r1"), MSGS)
    got = s.get("t", "r1")
    assert got is not None and got.response["id"] == "r1" and got.messages == MSGS
    assert len(s) == 1 and s.bytes == got.size == entry_size(resp("r1"), MSGS)
    assert s.put("t", resp("r1", "other"), MSGS)  # replaces, not duplicates
    again = s.get("t", "r1")
    assert len(s) == 1 and again is not None and s.bytes == again.size
    assert again.response["output"][0]["content"][0]["text"] == "other"
    assert s.delete("t", "r1") and not s.delete("t", "r1")
    assert s.get("t", "r1") is None and len(s) == 0 and s.bytes == 0


def test_tenants_are_isolated() -> None:
    s = store(Clock())
    s.put("alice", resp("r1", "alice's"), MSGS)
    assert s.get("bob", "r1") is None
    assert not s.delete("bob", "r1")
    s.put("bob", resp("r1", "bob's"), MSGS)  # the same id: another entry
    a, b = s.get("alice", "r1"), s.get("bob", "r1")
    assert a is not None and b is not None and len(s) == 2
    assert a.response["output"][0]["content"][0]["text"] == "alice's"
    assert b.response["output"][0]["content"][0]["text"] == "bob's"
    assert s.delete("bob", "r1") and s.get("alice", "r1") is not None


def test_count_bound_evicts_least_recently_used() -> None:
    s = store(Clock(), entries=3)
    for rid in ("r1", "r2", "r3"):
        s.put("t", resp(rid), MSGS)
    assert s.get("t", "r1") is not None  # r1 is now the most recently used
    s.put("u", resp("r4"), MSGS)  # over all tenants
    assert s.get("t", "r2") is None and len(s) == 3
    assert all(s.get(t, r) is not None for t, r in (("t", "r1"), ("t", "r3"), ("u", "r4")))


def test_byte_bound_evicts_until_it_fits() -> None:
    one = entry_size(resp("r1"), MSGS)
    s = store(Clock(), entries=100, max_bytes=3 * one)
    for rid in ("r1", "r2", "r3"):
        assert s.put("t", resp(rid), MSGS)
    assert len(s) == 3 and s.bytes == 3 * one
    big = resp("r4", "x" * one)  # about two entries' worth: r1 and r2 go
    assert s.put("t", big, MSGS)
    assert s.get("t", "r1") is None and s.get("t", "r2") is None
    assert s.get("t", "r3") is not None and s.get("t", "r4") is not None
    assert s.bytes == one + entry_size(big, MSGS) <= 3 * one


def test_an_entry_over_the_whole_budget_is_not_stored() -> None:
    one = entry_size(resp("r1"), MSGS)
    s = store(Clock(), max_bytes=2 * one)
    s.put("t", resp("r1"), MSGS)
    assert not s.put("t", resp("huge", "x" * 3 * one), MSGS)
    assert s.get("t", "huge") is None and s.get("t", "r1") is not None and len(s) == 1


def test_ttl_runs_from_the_put_and_reads_do_not_extend_it() -> None:
    clock = Clock()
    s = store(clock, ttl=60.0)
    s.put("t", resp("r1"), MSGS)
    clock.now += 30
    s.put("t", resp("r2"), MSGS)
    clock.now += 29.5
    assert s.get("t", "r1") is not None  # 59.5 s old
    clock.now += 0.5
    assert s.get("t", "r1") is None and len(s) == 1  # 60 s: gone, r2 (30 s) stays
    assert s.bytes == entry_size(resp("r2"), MSGS)
    clock.now += 29.9
    assert s.get("t", "r2") is not None
    clock.now += 0.1
    assert not s.delete("t", "r2") and len(s) == 0 and s.bytes == 0


def test_a_replaced_entry_expires_from_its_new_put() -> None:
    clock = Clock()
    s = store(clock, ttl=10.0)
    s.put("t", resp("r1"), MSGS)
    clock.now += 8
    s.put("t", resp("r1"), MSGS)
    clock.now += 8
    assert s.get("t", "r1") is not None


@pytest.mark.parametrize("args", [(0, 1, 1.0), (1, 0, 1.0), (1, 1, 0.0)])
def test_bounds_must_be_positive(args: tuple[int, int, float]) -> None:
    with pytest.raises(ValueError):
        ResponseStore(*args, clock=Clock())


def test_conversation_drops_system_and_adds_the_output() -> None:
    s = store(Clock())
    call = {"id": "fc_1", "type": "function_call", "call_id": "call_1",
            "name": "get_weather", "arguments": '{"city": "Paris"}', "status": "completed"}
    s.put("t", resp("r1", "Let me look.", [call]), MSGS)
    entry = s.get("t", "r1")
    assert entry is not None
    assert conversation(entry) == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}]
    s.put("t", resp("r2", ""), MSGS)  # no output at all: nothing to add
    empty = s.get("t", "r2")
    assert empty is not None and conversation(empty) == [{"role": "user", "content": "hi"}]
    new = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "more"}]
    assert continue_messages(new, entry, 1) == [new[0], *conversation(entry), new[1]]
    assert continue_messages(new[1:], entry, 0) == [*conversation(entry), new[1]]
    assert entry.messages == MSGS  # the stored messages are not changed


def test_frontend_flags_and_env() -> None:
    from services.common.config import ConfigError, load_config
    from services.frontend.main import FrontendConfig

    default = load_config(FrontendConfig, [], {}).responses_store()
    assert default is not None and default.max_entries == 10000  # stored by default
    assert load_config(FrontendConfig, ["--responses-store-size", "0"],
                       {}).responses_store() is None
    s = load_config(FrontendConfig, [], {"KVMESH_RESPONSES_STORE_SIZE": "5",
                                         "KVMESH_RESPONSES_STORE_MIB": "1",
                                         "KVMESH_RESPONSES_STORE_TTL_S": "9"}
                    ).responses_store()
    assert s is not None and (s.max_entries, s.max_bytes, s.ttl_s) == (5, 1 << 20, 9.0)
    for flag, value in (("--responses-store-size", "-1"), ("--responses-store-mib", "0"),
                        ("--responses-store-ttl-s", "0")):
        name = flag.removeprefix("--").replace("-", "_")
        with pytest.raises(ConfigError, match=name):
            load_config(FrontendConfig, [flag, value], {})
