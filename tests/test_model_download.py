"""A GGUF given by URL is downloaded once (from a real HTTP server on loopback), checked, cached, and loads."""

from __future__ import annotations

import functools
import http.server
import threading

import pytest

from ppharness.errors import ModelError
from ppharness.model.gguf_file import GGUFFile
from ppharness.model.sources.files import resolve_model, sha256_file
from ppharness.model.synthetic.spec import ModelSpec
from ppharness.model.synthetic.writer import make_synthetic


@pytest.fixture
def served(tmp_path, monkeypatch):
    monkeypatch.setenv("PPHARNESS_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "www"
    model = make_synthetic(ModelSpec(blocks=2, dim=16, ffn=32, heads=2, kv_heads=1, vocab=300), root / "m.gguf")
    hits: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            hits.append(self.path)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", model, hits
    server.shutdown()
    server.server_close()


def test_url_is_downloaded_once_and_checked(served):
    base, model, hits = served
    digest = sha256_file(model)
    first = resolve_model(f"{base}/m.gguf", digest)
    again = resolve_model(f"{base}/m.gguf", digest)
    assert first == again and sha256_file(first) == digest
    assert len([h for h in hits if h.endswith("m.gguf")]) == 1
    assert GGUFFile(first).config.blocks == 2


def test_wrong_digest_removes_the_download(served):
    base, _, _ = served
    with pytest.raises(ModelError, match="does not match"):
        resolve_model(f"{base}/m.gguf", "f" * 64)
    with pytest.raises(ModelError, match=r"downloading \S+/missing\.gguf failed") as info:
        resolve_model(f"{base}/missing.gguf")
    assert info.value.__cause__.response.status_code == 404  # type: ignore[union-attr]


def test_an_unpinned_download_prints_its_sha256(served, capsys):
    base, model, _ = served
    path = resolve_model(f"{base}/m.gguf")
    err = capsys.readouterr().err
    assert f"sha256 {sha256_file(model)}" in err and "model.sha256" in err
    resolve_model(f"{base}/m.gguf")
    assert "sha256" not in capsys.readouterr().err  # cached: nothing downloaded, nothing printed
    assert sha256_file(path) == sha256_file(model)


def test_a_registry_blob_url_is_checked_against_its_digest(served, capsys):
    base, model, hits = served
    digest = sha256_file(model)
    blobs = model.parent / "v2" / "library" / "m" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / f"sha256:{digest}").write_bytes(model.read_bytes())
    (blobs / f"sha256:{'e' * 64}").write_bytes(model.read_bytes())  # served under a digest that is not its own
    path = resolve_model(f"{base}/v2/library/m/blobs/sha256:{digest}")
    assert sha256_file(path) == digest and GGUFFile(path).config.blocks == 2
    assert "model.sha256" not in capsys.readouterr().err  # pinned by its URL: nothing to print
    with pytest.raises(ModelError, match="does not match"):
        resolve_model(f"{base}/v2/library/m/blobs/sha256:{'e' * 64}")
