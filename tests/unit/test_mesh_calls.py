"""bench.mesh_profile.calls' counting: where a request's frontend and worker calls start
and end, and a path whose markers are missing fails rather than counts wrong."""

from __future__ import annotations

import pytest

from bench.mesh_profile import calls

F = "/x/services/frontend/a.py"
C = "/x/services/common/frames.py"


def _calls(*names: str, file: str = F) -> list[tuple[int, str, str]]:
    return [(i, C if "FramedProtocol" in n else file, n) for i, n in enumerate(names)]


def test_counts_each_side_of_the_worker_and_the_worker() -> None:
    front = _calls("a", "b", "FramedProtocol._send", "idle", "FramedProtocol.data_received",
                   "c", "DirectPostsMixin._direct_write", "after")
    fleet = _calls("w1", "w2", "FramedProtocol._send", "w3", file="/x/workers/w.py")
    got = calls.split(front, fleet)
    assert (got["before_worker"], got["after_worker"], got["worker"]) == (3, 3, 3)
    assert got["path"] == ["services/frontend/a.py:a", "services/frontend/a.py:b",
                           "services/common/frames.py:FramedProtocol._send",
                           "services/common/frames.py:FramedProtocol.data_received",
                           "services/frontend/a.py:c",
                           "services/frontend/a.py:DirectPostsMixin._direct_write"]
    report = calls.summarize([(front, fleet), (front[:1] + front, fleet)])
    assert report["frontend_calls_p50"] == 6.5 and report["worker_calls_p50"] == 3
    # the median request of two: the upper one (a repeated first call)
    assert report["median_request"]["by_module"]["services/frontend/a.py"] == 5


def test_a_missing_marker_fails() -> None:
    front = _calls("a", "FramedProtocol._send", "b")  # no reply read, no answer
    with pytest.raises(RuntimeError, match="FramedProtocol.data_received"):
        calls.split(front, _calls("FramedProtocol._send"))
    with pytest.raises(RuntimeError, match="no request"):
        calls.summarize([])
