"""workers.engines.afd.worker's NIXL wiring without NIXL or etcd: the FFN record's info
label, the record fields, and the config accepting ``--afd-transport nixl`` (the pairing
itself runs in tests/integration/test_afd_mesh_nixl.py)."""

from __future__ import annotations

import base64

import pytest

from protos import discovery_pb2
from services.common.config import load_config
from services.common.discovery import AFD_ATTENTION, AFD_FFN
from workers.config import WorkerConfig
from workers.engines.afd.worker import NIXL_INFO_LABEL, afd_record_fields, ffn_nixl_info


def cfg(*args: str) -> WorkerConfig:
    return load_config(WorkerConfig, ["--engine", "afd", "--afd-transport", "nixl",
                                      "--insecure", "--model-path", "tiny", *args], {})


def test_nixl_is_accepted_and_an_ffn_record_needs_its_engine() -> None:
    ffn = cfg("--afd-role", "ffn", "--worker-id", "f0")
    assert ffn.problems() == []
    with pytest.raises(RuntimeError, match="started engine"):
        afd_record_fields(ffn, ["generate"], 0)
    attn = cfg("--afd-role", "attention", "--afd-ffn-id", "f0")
    assert attn.problems() == []
    caps, _, labels = afd_record_fields(attn, ["generate"], 0)
    assert AFD_ATTENTION in caps and labels["afd_transport"] == "nixl"
    assert NIXL_INFO_LABEL not in labels  # the attention side announces itself in band


def test_ffn_nixl_info_reads_only_an_ffn_records_base64_label() -> None:
    info = b"\x00KVAFDNX1 opaque \xff"
    rec = discovery_pb2.InstanceRecord(instance_id="f0", capabilities=[AFD_FFN], labels={
        NIXL_INFO_LABEL: base64.b64encode(info).decode()})
    assert ffn_nixl_info(rec) == info
    assert ffn_nixl_info(None) is None
    not_ffn = discovery_pb2.InstanceRecord(instance_id="a0", capabilities=[AFD_ATTENTION],
                                           labels=dict(rec.labels))
    assert ffn_nixl_info(not_ffn) is None
    rec.labels[NIXL_INFO_LABEL] = "not base64 !"
    assert ffn_nixl_info(rec) is None
    del rec.labels[NIXL_INFO_LABEL]
    assert ffn_nixl_info(rec) is None
