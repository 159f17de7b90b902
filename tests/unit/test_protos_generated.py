"""Generated protobuf code is committed; regenerating it must change nothing."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_regenerating_protos_changes_nothing(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "protos", tmp_path / "protos",
                    ignore=shutil.ignore_patterns("*_pb2*", "__pycache__"))
    protos = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "protos").glob("*.proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", ".", "--python_out=.",
                    "--grpc_python_out=.", "--pyi_out=.", *protos], cwd=tmp_path, check=True)
    generated = sorted(p.name for p in (tmp_path / "protos").glob("*_pb2*"))
    committed = sorted(p.name for p in (ROOT / "protos").glob("*_pb2*"))
    assert generated == committed
    for name in generated:
        new, old = tmp_path / "protos" / name, ROOT / "protos" / name
        assert new.read_bytes() == old.read_bytes(), name
