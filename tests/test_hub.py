"""Pulling checkpoints: from a Hub cache offline (the real huggingface_hub code path), pinned revisions, local
folders, and every failure turned into a PullError that names repo, revision and what to do. Hub answers
(repo not found, revision not found, gated) come from a local HTTP server speaking the Hub's error headers."""

from __future__ import annotations

import http.server
import json
import socket
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from zoo.export import pull as hub
from zoo.export import tiny_hub
from zoo.core.errors import PullError
from zoo.export.hub_cache import folder_commit, hub_environment, put_in_cache, repo_folder


def recipe_for(repo_id="org/model", revision="main", local_dir=None, allow_patterns=()):
    source = SimpleNamespace(repo_id=repo_id, revision=revision, local_dir=local_dir,
                             allow_patterns=list(allow_patterns), fabricate=False, seed=0)
    return SimpleNamespace(source=source)


def weights_file(label: bytes) -> bytes:
    """A whole safetensors file told apart by ``label`` (pull refuses a truncated or foreign one)."""
    import torch
    from safetensors.torch import save

    return save({"w": torch.zeros(2)}, metadata={"label": label.decode()})


def checkpoint_folder(root: Path, weights: bytes = b"weights") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"type": "toy"}))
    (root / "model.safetensors").write_bytes(weights_file(weights))
    return root


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "hub-cache"


def test_pull_from_cache_offline(tmp_path, cache):
    src = checkpoint_folder(tmp_path / "src")
    commit = put_in_cache("org/model", src, cache)
    with hub_environment(cache, offline=True):
        ckpt = hub.pull(recipe_for())
    # The resolved commit is the snapshot the refs/main file points to, read independently here.
    assert (repo_folder(cache, "org/model") / "refs" / "main").read_text() == commit
    assert ckpt.commit == commit and ckpt.path.name == commit
    assert (ckpt.path / "model.safetensors").read_bytes() == weights_file(b"weights")
    assert ckpt.offline is True and ckpt.local_dir is None
    assert ckpt.as_dict()["repo_id"] == "org/model"


def test_pinned_commit_is_used_offline(tmp_path, cache):
    old = put_in_cache("org/model", checkpoint_folder(tmp_path / "v1", b"old"), cache)
    put_in_cache("org/model", checkpoint_folder(tmp_path / "v2", b"new"), cache)  # main now points here
    with hub_environment(cache, offline=True):
        pinned = hub.pull(recipe_for(revision=old))
        latest = hub.pull(recipe_for())
    assert (pinned.path / "model.safetensors").read_bytes() == weights_file(b"old")
    assert (latest.path / "model.safetensors").read_bytes() == weights_file(b"new")
    assert pinned.commit == old == folder_commit(tmp_path / "v1")


def test_offline_and_not_cached(cache):
    with hub_environment(cache, offline=True), pytest.raises(PullError) as err:
        hub.pull(recipe_for("org/absent", "v3"))
    message, hint = str(err.value), err.value.hint
    assert "'org/absent'" in message and "'v3'" in message and "HF_HUB_OFFLINE" in message
    assert "run once with network" in hint and "python -m zoo bundle" in hint and "source.local_dir=" in hint


def test_offline_revision_not_cached(tmp_path, cache):
    put_in_cache("org/model", checkpoint_folder(tmp_path / "src"), cache)
    with hub_environment(cache, offline=True), pytest.raises(PullError) as err:
        hub.pull(recipe_for(revision="release-2"))
    assert "'release-2'" in str(err.value) and "not in the Hub cache" in str(err.value)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_network_down(cache, monkeypatch):
    from huggingface_hub import constants

    # Nothing listens on this port: the connection is refused at once, as with no network.
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")
    with hub_environment(cache, offline=False), pytest.raises(PullError) as err:
        hub.pull(recipe_for("org/model", "main"))
    assert "could not be fetched" in str(err.value) and "'org/model'" in str(err.value)
    assert "python -m zoo bundle" in err.value.hint


class FakeHub(http.server.BaseHTTPRequestHandler):
    """Answers the repo-info call as the Hub does: an error status, X-Error-Code and a JSON message."""

    answers = {
        "/api/models/org/missing/revision/main": (404, "RepoNotFound", "Repository not found"),
        "/api/models/org/model/revision/nope": (404, "RevisionNotFound", "Invalid rev id: nope"),
        "/api/models/org/gated/revision/main": (403, "GatedRepo", "Access to model org/gated is restricted"),
    }

    def do_GET(self):  # noqa: N802 - http.server's name
        status, code, message = self.answers.get(self.path, (500, "", "unexpected"))
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_hub(monkeypatch):
    from huggingface_hub import constants

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("HF_TOKEN", "hf_test_token_not_real")  # no login prompt, no real token read
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("repo, revision, words, hint_words", [
    ("org/missing", "main", "repo 'org/missing' was not found on the Hub", "check source.repo_id"),
    ("org/model", "nope", "revision 'nope' does not exist in 'org/model'", "source.revision"),
    ("org/gated", "main", "'org/gated' at revision 'main' is gated", "accept the license"),
])
def test_hub_answers_become_pull_errors(cache, fake_hub, repo, revision, words, hint_words):
    with hub_environment(cache, offline=False), pytest.raises(PullError) as err:
        hub.pull(recipe_for(repo, revision))
    assert words in str(err.value)
    assert hint_words in err.value.hint


def test_local_dir(tmp_path):
    folder = checkpoint_folder(tmp_path / "ckpt")
    ckpt = hub.pull(recipe_for(local_dir=str(folder)))
    assert ckpt.path == folder.resolve() and ckpt.commit is None and ckpt.local_dir == str(folder.resolve())


def test_local_dir_missing(tmp_path):
    with pytest.raises(PullError) as err:
        hub.pull(recipe_for(local_dir=str(tmp_path / "nowhere")))
    assert "nowhere does not exist" in str(err.value)


def test_local_dir_without_weights(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(PullError) as err:
        hub.pull(recipe_for(local_dir=str(folder)))
    assert "lacks model.safetensors or model.safetensors.index.json" in str(err.value)
    assert "pytorch_model.bin" in str(err.value)  # says what is there instead


def test_local_dir_without_config(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(PullError, match="lacks config.json"):
        hub.pull(recipe_for(local_dir=str(folder)))


def test_sharded_checkpoint_is_accepted(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors.index.json").write_text("{}")
    assert hub.pull(recipe_for(local_dir=str(folder))).path == folder.resolve()


def test_cached_snapshot_without_weights(tmp_path, cache):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    put_in_cache("org/model", src, cache)
    with hub_environment(cache, offline=True), pytest.raises(PullError) as err:
        hub.pull(recipe_for())
    assert "org/model@main is not a checkpoint" in str(err.value)


def test_fabricate_is_deterministic_and_serves_aux_repos(toy_family, test_recipe, tmp_path):
    recipe = test_recipe("toy-rope")
    first = tiny_hub.fabricate(recipe, tmp_path / "tiny")
    second = tiny_hub.fabricate(recipe, tmp_path / "tiny")
    assert first == second  # seeded: same bytes, same commit ids
    assert set(first) == {"zoo-test/toy-rope", "toy-org/toy-aux"}
    for repo_id, commit in first.items():
        assert (repo_folder(tmp_path / "tiny", repo_id) / "refs" / "main").read_text() == commit
    other_seed = tiny_hub.fabricate(test_recipe("toy-rope", "source.seed=4"), tmp_path / "tiny2")
    assert other_seed["zoo-test/toy-rope"] != first["zoo-test/toy-rope"]


def test_fabricated_hub_is_offline_and_restores(toy_family, test_recipe, tmp_path):
    from huggingface_hub import constants

    before = (constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE)
    recipe = test_recipe("toy-rope")
    with tiny_hub.fabricated_hub(recipe, tmp_path / "tiny") as cache_dir:
        assert constants.HF_HUB_OFFLINE is True and constants.HF_HUB_CACHE == str(cache_dir)
        ckpt = hub.pull(recipe)
        aux = hub.snapshot("toy-org/toy-aux", "main")
    assert (constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE) == before
    assert json.loads((ckpt.path / "config.json").read_text())["model_type"] == "zoo_toy"
    assert json.loads((aux / "config.json").read_text()) == {"what": "toy auxiliary repo"}


def test_fabricate_must_return_the_recipes_repo(test_recipe, tmp_path, monkeypatch):
    import zoo.policies
    from zoo.core.errors import ExportError

    family = SimpleNamespace(fabricate_checkpoint=lambda recipe, work: {"other/repo": checkpoint_folder(work / "x")})
    monkeypatch.setattr(zoo.policies, "load_family", lambda name: family)
    with pytest.raises(ExportError, match="not the recipe's repo 'zoo-test/toy-rope'"):
        tiny_hub.fabricate(test_recipe("toy-rope"), tmp_path / "tiny")


def test_checkpoint_into_cache_fabricated(toy_family, test_recipe, tmp_path):
    commits = hub.checkpoint_into_cache(test_recipe("toy-rope"), tmp_path / "bundle-hub")
    assert set(commits) == {"zoo-test/toy-rope", "toy-org/toy-aux"}
    assert hub.cached_commits(tmp_path / "bundle-hub") == commits


def test_checkpoint_into_cache_from_the_hub_cache(toy_family, test_recipe, tmp_path):
    # Offline stand-in for a download: the recipe's repo and the repo its policy loads by id are in the
    # bundle's cache; the unit is built against that cache (load_aux reads toy-org/toy-aux from it).
    recipe = test_recipe("toy-rope", "source.fabricate=false", "unit.options.load_aux=true")
    folders = toy_family.fabricate_checkpoint(recipe, tmp_path / "fab")
    cache = tmp_path / "bundle-hub"
    main = put_in_cache("zoo-test/toy-rope", folders["zoo-test/toy-rope"], cache)
    put_in_cache("toy-org/toy-aux", folders["toy-org/toy-aux"], cache)
    assert hub.checkpoint_into_cache(recipe, cache) == {"zoo-test/toy-rope": main}


def test_checkpoint_into_cache_files_a_local_folder_under_its_repo_id(tmp_path):
    folder = checkpoint_folder(tmp_path / "ckpt")
    recipe = recipe_for("org/local-model", "main", local_dir=str(folder))
    commits = hub.checkpoint_into_cache(recipe, tmp_path / "bundle-hub")
    assert commits == {"org/local-model": folder_commit(folder)}
    # On the target, the same recipe without local_dir pulls it from the bundle's cache, offline.
    with hub_environment(tmp_path / "bundle-hub", offline=True):
        ckpt = hub.pull(recipe_for("org/local-model"))
    assert (ckpt.path / "model.safetensors").read_bytes() == weights_file(b"weights")


def test_network_errors_are_recognised():
    httpx = pytest.importorskip("httpx")
    assert hub._network_error(httpx.ProxyError("proxy refused"))
    assert hub._network_error(httpx.ConnectTimeout("slow"))
    assert hub._network_error(ConnectionRefusedError())
    assert not hub._network_error(ValueError("a bug, not the network"))
