"""CURVE key files: written private and whole, read strictly, each problem
named with its file (a bad key used to surface later as a bare "Invalid
argument" from libzmq, or as a shard that refused its worker for good)."""

import os
import pathlib
import subprocess
import sys

import pytest
import zmq

from keras_geeps import auth


@pytest.fixture
def pair(tmp_path):
    public, secret = auth.keygen(str(tmp_path), "worker0")
    return public, secret


def _rewrite(path, old, new):
    with open(path) as f:
        text = f.read()
    assert old in text
    with open(path, "w") as f:
        f.write(text.replace(old, new))


def test_a_keygen_pair_loads(pair):
    public, secret = pair
    loaded = auth.load_keypair(secret)
    assert auth.load_keypair(pathlib.Path(secret)) == loaded
    assert auth.load_keypair(public) == (loaded[0], None)
    assert zmq.curve_public(loaded[1]) == loaded[0]


@pytest.mark.parametrize("change,problem", [
    (lambda key: key[:-1], "not 40 Z85 characters"),
    (lambda key: key[:-1] + "~", "not 40 Z85 characters"),
    (lambda key: "#" * 40, "does not decode to 32 bytes"),
])
def test_a_malformed_public_key_is_named_with_its_file(pair, change,
                                                       problem):
    public = pair[0]
    key = auth.load_keypair(public)[0].decode()
    _rewrite(public, key, change(key))
    with pytest.raises(ValueError, match=problem) as raised:
        auth.load_keypair(public)
    assert public in str(raised.value)


@pytest.mark.parametrize("text,problem", [
    ('public-key-typo = "{key}"\n', "is not `<public|secret>-key"),
    ('public-key = "{key}"\npublic-key = "{key}"\n', "a second public-key"),
    ("metadata\n", "holds no public-key line"),
    (b"\xff\xfe", "not UTF-8"),
])
def test_lines_a_certificate_does_not_hold_are_refused(pair, tmp_path,
                                                       text, problem):
    key = auth.load_keypair(pair[0])[0].decode()
    path = tmp_path / "odd.key"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text.format(key=key))
    with pytest.raises(ValueError, match=problem):
        auth.load_keypair(str(path))


def test_a_secret_others_may_read_is_refused(pair):
    os.chmod(pair[1], 0o644)
    with pytest.raises(ValueError, match="others may read it .*chmod 600"):
        auth.load_keypair(pair[1])


def test_a_public_key_that_is_not_its_secrets_is_refused(pair, tmp_path):
    other = auth.keygen(str(tmp_path / "other"), "worker0")[0]
    theirs = auth.load_keypair(other)[0].decode()
    mine = auth.load_keypair(pair[0])[0].decode()
    _rewrite(pair[1], mine, theirs)
    with pytest.raises(ValueError, match="not the one of its secret key"):
        auth.load_keypair(pair[1])


def test_keygen_force_interrupted_between_its_renames_is_caught(
        pair, monkeypatch):
    """The public key was renamed first: killed before the secret's
    rename, the new public key sat beside the old secret, which nothing
    noticed, and the worker was refused with only a timeout. A secret
    whose `.key` beside it holds another key is refused by name."""
    real_replace = os.replace
    calls = []

    def fail_second(source, target):
        calls.append(target)
        if len(calls) == 2:
            raise OSError("killed between the renames")
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", fail_second)
    with pytest.raises(OSError, match="killed"):
        auth.keygen(os.path.dirname(pair[0]), "worker0", overwrite=True)
    monkeypatch.setattr(os, "replace", real_replace)
    with pytest.raises(ValueError, match="holds another public key"):
        auth.load_keypair(pair[1])
    # (the shard's copy of the public key is the old one: still valid)
    assert auth.load_keypair(pair[0])[1] is None


def test_an_allowed_clients_folder_others_may_write_is_refused(tmp_path):
    secret = auth.keygen(str(tmp_path), "shard")[1]
    allowed = tmp_path / "allowed"
    auth.keygen(str(allowed), "worker0")
    os.chmod(allowed, 0o777)
    context = zmq.Context()
    try:
        with pytest.raises(ValueError, match="may be written by others"):
            auth.ShardAuth(context, secret, str(allowed))
    finally:
        context.term()


def test_the_package_gives_auth_as_the_docs_write_it(pair):
    """`keras_geeps.auth.ClientKeys(...)` right after `import keras_geeps`
    (a fresh interpreter: here `auth` is imported already), without
    TensorFlow."""
    public, secret = pair
    code = ("import sys, keras_geeps\n"
            f"keras_geeps.auth.ClientKeys({secret!r}, {public!r})\n"
            "assert 'tensorflow' not in sys.modules\n")
    result = subprocess.run([sys.executable, "-c", code],
                            capture_output=True, text=True, timeout=120,
                            cwd=pathlib.Path(__file__).parent.parent)
    assert result.returncode == 0, result.stderr
