"""Redis credentials and signed KV events without a server: the ACL builder
(:mod:`services.common.redis_acl`), the secrets next to the mesh certificates
(:func:`services.common.tls.write_mesh_certs`), and the entry MAC of
:mod:`services.common.event_bus`."""

from __future__ import annotations

import hashlib
import hmac
import stat
from pathlib import Path

import pytest

from protos import kv_events_pb2
from services.common.event_bus import (
    BATCH,
    FORGED,
    STATE,
    UNSIGNED,
    BadEntry,
    BadSignature,
    decode_entry,
    encode_batch,
    encode_state,
    mac_input,
)
from services.common.redis_acl import ACL_FILE, acl_lines, sync_stream, write_acl_file
from services.common.tls import (
    EVENTS_KEY,
    ROLES,
    CertError,
    MeshTls,
    derive_event_key,
    redis_password_file,
    write_mesh_certs,
)

NS = "ns1"
STREAM = "kvmesh:ns1:kv-events"


def user_line(lines: list[str], user: str) -> list[str]:
    return next(line for line in lines if line.startswith(f"user {user} ")).split()


def test_acl_lines_one_user_per_role_default_off_passwords_hashed() -> None:
    pw = {r: f"pw-{r}" for r in ("worker", "indexer", "router", "store_master", "admin")}
    lines = acl_lines(NS, pw)
    assert lines[0] == "user default reset off"
    assert len(lines) == 6
    for role, password in pw.items():
        words = user_line(lines, role)
        assert words[2:4] == ["reset", "on"]
        assert f"#{hashlib.sha256(password.encode()).hexdigest()}" in words
        assert not any(password in w for w in words)  # only the hash
    worker = user_line(lines, "worker")
    assert worker[5:] == ["-@all", "+ping", "+xadd", f"%W~{STREAM}"]
    indexer = user_line(lines, "indexer")
    assert f"~{STREAM}" in indexer and "+xreadgroup" in indexer and "+info" in indexer
    assert "+xadd" not in indexer and not any(w.startswith("+@") for w in indexer)
    # the router: the indexer's rules, plus a selector for its replica sync stream
    router = user_line(lines, "router")
    assert router[5:5 + len(indexer) - 5] == indexer[5:]
    assert router[-4:] == ["+time", "(+xadd", "+xread", f"~{sync_stream(NS)})"]
    assert not any(w.startswith("+@") for w in router)
    store = user_line(lines, "store_master")
    assert "~kvmesh:ns1:store:*" in store and "-@dangerous" in store
    assert store.index("-@dangerous") > store.index("+@write")  # dangerous removed after
    assert "-scan" in store and "~*" not in store
    assert user_line(lines, "admin")[5:] == ["+@all", "~*", "&*"]


def test_acl_lines_refuse_unknown_roles_bad_namespaces_and_empty_passwords() -> None:
    assert acl_lines(NS, {}) == ["user default reset off"]
    with pytest.raises(ValueError, match="role: no Redis ACL rules for 'frontend'"):
        acl_lines(NS, {"frontend": "x"})
    with pytest.raises(ValueError, match="namespace: "):
        acl_lines("a*b", {"worker": "x"})
    with pytest.raises(ValueError, match=r"passwords\['worker'\]: empty"):
        acl_lines(NS, {"worker": ""})


def test_mesh_secrets_next_to_the_certificates(tmp_path: Path) -> None:
    written = {p.name for p in write_mesh_certs(tmp_path, ["worker:wa", "indexer", "redis"])}
    assert {EVENTS_KEY, "redis-worker.pass", "redis-indexer.pass", "worker-wa.evkey"} <= written
    assert "redis-redis.pass" not in written  # redis is the server, not an ACL user
    for name in (EVENTS_KEY, "redis-worker.pass", "worker-wa.evkey"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600
    secret = (tmp_path / EVENTS_KEY).read_bytes()
    assert len(secret) == 32
    assert (tmp_path / "worker-wa.evkey").read_bytes() == derive_event_key(secret, "wa")
    assert derive_event_key(secret, "wa") != derive_event_key(secret, "wb")
    password = (tmp_path / redis_password_file("worker")).read_bytes()
    assert len(password) == 64 and int(password, 16) >= 0
    # idempotent: nothing is rewritten; force renews passwords, never the events secret
    assert write_mesh_certs(tmp_path, ["worker:wa", "indexer"]) == []
    again = {p.name for p in write_mesh_certs(tmp_path, ["worker:wa"], force=True)}
    assert again == {"worker-wa.pem", "worker-wa-key.pem", "redis-worker.pass"}
    assert (tmp_path / EVENTS_KEY).read_bytes() == secret
    assert (tmp_path / redis_password_file("worker")).read_bytes() != password
    tls = MeshTls.load(tmp_path, "worker-wa")
    assert (tls.folder, tls.stem) == (tmp_path, "worker-wa")
    assert tls.secret("worker-wa.evkey") == derive_event_key(secret, "wa")
    with pytest.raises(CertError, match=r"missing .*redis-admin\.pass"):
        tls.secret(redis_password_file("admin"))


def test_write_acl_file_uses_the_passwords_found(tmp_path: Path) -> None:
    write_mesh_certs(tmp_path, ROLES)
    path = write_acl_file(tmp_path, NS)
    assert path == tmp_path / ACL_FILE and stat.S_IMODE(path.stat().st_mode) == 0o600
    users = [line.split()[1] for line in path.read_text().splitlines()]
    assert users == ["default", "admin", "indexer", "router", "store_master", "worker"]
    assert write_acl_file(tmp_path, NS).read_text() == path.read_text()


def batch(worker: str, first: int = 0) -> kv_events_pb2.KvEventBatch:
    return kv_events_pb2.KvEventBatch(worker_id=worker, block_size=16, events=[
        kv_events_pb2.KvEvent(event_id=first, kind=kv_events_pb2.KV_EVENT_KIND_STORED,
                              block_hashes=[7, 8])])


def state(worker: str, event_id: int = 99) -> kv_events_pb2.KvState:
    return kv_events_pb2.KvState(worker_id=worker, event_id=event_id, tiers=[
        kv_events_pb2.TierBlocks(tier="device", block_hashes=[1, 2, 3])])


SECRET = b"s" * 32


def keys(worker: str) -> bytes:
    return derive_event_key(SECRET, worker)


def test_signed_entries_round_trip_and_name_their_sender() -> None:
    for msg, enc in ((batch("wa"), encode_batch), (state("wa"), encode_state)):
        fields = enc(msg, keys("wa"))  # type: ignore[operator]
        assert set(fields) == {b"w", b"k", b"d", b"m"}
        assert decode_entry(fields, keys) == msg
        assert decode_entry(fields) == msg  # a mesh without certificates ignores m
    assert mac_input(b"wa", BATCH, b"xy") == b"kvmesh-ev1\x00\x00\x00\x02wabxy"


def reason(fields: dict[bytes, bytes]) -> str:
    with pytest.raises(BadSignature) as info:
        decode_entry(fields, keys)
    return f"{info.value.reason} {info.value.worker_id}"


def test_unsigned_and_forged_entries_are_refused_with_keys() -> None:
    assert reason(encode_state(state("wb"))) == f"{UNSIGNED} wb"
    assert decode_entry(encode_state(state("wb"))) == state("wb")  # no keys: as before
    assert reason(encode_state(state("wb"), keys("wa"))) == f"{FORGED} wb"  # A's key
    assert reason(encode_batch(batch("wb"), keys("wa"))) == f"{FORGED} wb"
    tampered = encode_batch(batch("wb"), keys("wb"))
    tampered[b"d"] = batch("wb", first=5).SerializeToString()
    assert reason(tampered) == f"{FORGED} wb"
    relabelled = encode_state(state("wb"), keys("wb"))
    relabelled[b"k"] = BATCH
    assert reason(relabelled) == f"{FORGED} wb"
    # A signs, as itself, an entry whose message carries B's events
    data = state("wb").SerializeToString()
    mixed = {b"w": b"wa", b"k": STATE, b"d": data,
             b"m": hmac.new(keys("wa"), mac_input(b"wa", STATE, data), "sha256").digest()}
    with pytest.raises(BadSignature, match="carries events of 'wb'") as info:
        decode_entry(mixed, keys)
    assert info.value.reason == FORGED
    with pytest.raises(BadSignature, match="no event key"):
        decode_entry(encode_batch(batch("wa"), keys("wa")), lambda w: None)
    assert isinstance(BadSignature(FORGED, "w", "x"), BadEntry)
    with pytest.raises(BadEntry, match="not a KV event entry"):
        decode_entry({b"w": b"wa"}, keys)


def test_a_signer_signs_for_its_sub_ids_and_names_itself() -> None:
    """A fleet's certificate ``fleet`` signs the events of ``fleet.a0``: the entry names its
    signer (``s``, covered by the MAC) and verifies under the signer's key."""
    for msg, enc in ((batch("fleet.a0"), encode_batch), (state("fleet.a0"), encode_state)):
        fields = enc(msg, keys("fleet"), "fleet")  # type: ignore[operator]
        assert set(fields) == {b"w", b"k", b"d", b"s", b"m"} and fields[b"s"] == b"fleet"
        assert decode_entry(fields, keys) == msg
        assert decode_entry(fields) == msg  # a mesh without certificates ignores s and m
    # a signer equal to the worker id is left out: the entry is today's
    assert encode_batch(batch("wa"), keys("wa"), "wa") == encode_batch(batch("wa"), keys("wa"))
    assert mac_input(b"fleet.a0", BATCH, b"xy", b"fleet") == \
        b"kvmesh-ev2\x00\x00\x00\x05fleet\x00\x00\x00\x08fleet.a0bxy"


def signed_by(signer: str, worker: str, key_of: str = "") -> dict[bytes, bytes]:
    return encode_batch(batch(worker), keys(key_of or signer), signer)


def test_a_signer_may_not_act_as_another_id() -> None:
    with pytest.raises(BadSignature, match="'fleet' may not act as 'other.0'") as info:
        decode_entry(signed_by("fleet", "other.0"), keys)
    assert (info.value.reason, info.value.worker_id, info.value.signer) == \
        (FORGED, "other.0", "fleet")
    for worker in ("fleetx", "fleet.", "fleet.a.b", "x.fleet", "fleet-b.0"):
        assert reason(signed_by("fleet", worker)) == f"{FORGED} {worker}", worker
    # fleet's key, naming another signer that would own the id
    assert reason(signed_by("fleet-o", "fleet-o.0", key_of="fleet")) == f"{FORGED} fleet-o.0"
    # a signer name changed, or dropped, after signing
    renamed = signed_by("fleet", "fleet.a0")
    renamed[b"s"] = b"fleet.a0"
    assert reason(renamed) == f"{FORGED} fleet.a0"
    dropped = signed_by("fleet", "fleet.a0")
    del dropped[b"s"]
    assert reason(dropped) == f"{FORGED} fleet.a0"
    # the shared worker certificate has no sub-ids
    assert reason(signed_by("worker", "worker.0")) == f"{FORGED} worker.0"
    empty = signed_by("fleet", "fleet.a0")
    empty[b"s"] = b""
    with pytest.raises(BadEntry, match="signer"):
        decode_entry(empty, keys)
    assert reason({**encode_batch(batch("fleet.a0")), b"s": b"fleet"}) == \
        f"{UNSIGNED} fleet.a0"


@pytest.mark.parametrize("name", ["prefill-0", "decode-0", "w0", "fl"])
def test_a_real_workers_events_for_ids_of_its_making_are_forged(name: str) -> None:
    """A compromised real worker (its certificate no fleet certificate) signs, with its
    own valid key, events for records ``<name>.<x>`` it would register to claim prefixes:
    every one is dropped as forged, whether it names itself as signer or not; its own
    id's events verify."""
    for worker in (f"{name}.x", f"{name}.fake", f"{name}.a0"):
        for fields in (signed_by(name, worker), encode_batch(batch(worker), keys(name)),
                       encode_state(state(worker), keys(name), name)):
            assert reason(fields) == f"{FORGED} {worker}", (worker, fields)
        with pytest.raises(BadSignature, match=f"{name!r} may not act as {worker!r}"):
            decode_entry(signed_by(name, worker), keys)
    assert decode_entry(signed_by(name, name), keys) == batch(name)
