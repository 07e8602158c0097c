"""A test leaves nothing outside its temporary folders (docs/CONTRIBUTING.md): erpo's user cache, the weight files'
digests that model fingerprints keep (erpo.models.fingerprint), goes under the session's temporary folder, in the
test's process and in the processes it launches (tests/conftest.py), not under the real HOME."""
import json
import os
import subprocess
import sys

from erpo.models.fingerprint import fingerprint_cache_path, model_fingerprint


def test_model_fingerprints_keep_their_digests_under_the_sessions_temporary_folder(tmp_path, tmp_path_factory):
    session = tmp_path_factory.getbasetemp()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    model_fingerprint(str(model))
    assert fingerprint_cache_path().is_relative_to(session), fingerprint_cache_path()
    assert str(model / "model.safetensors") in json.loads(fingerprint_cache_path().read_text())
    child = subprocess.run([sys.executable, "-c", "from erpo.models.fingerprint import fingerprint_cache_path as p; "
                            "print(p())"], env=dict(os.environ), capture_output=True, text=True, check=True)
    assert child.stdout.strip() == str(fingerprint_cache_path())   # a launched process inherits it
