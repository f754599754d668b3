"""The key file (`--api-keys-file`) and key lookup, without a server."""

from __future__ import annotations

import hashlib

import pytest

from waferscale.api.auth import ANONYMOUS, Keyring
from waferscale.api.keys import KeyFileError, load_key_file
from waferscale.api.limits import Limits


def write(tmp_path, text: str):
    path = tmp_path / "keys.toml"
    path.write_text(text)
    return path


def test_a_key_file_gives_names_digests_and_limits(tmp_path):
    digest = hashlib.sha256(b"sk-bob").hexdigest()
    specs = load_key_file(
        write(
            tmp_path,
            f'[keys.alice]\nkey = "sk-alice"\nrequests_per_minute = 3\ntokens_per_day = 1000000\n'
            f'[keys.bob]\nkey_sha256 = "{digest}"\n',
        )
    )
    alice, bob = specs
    assert alice.name == "alice" and alice.digest == hashlib.sha256(b"sk-alice").digest()
    assert alice.limits == Limits(requests_per_minute=3, tokens_per_day=1_000_000)
    assert bob.digest.hex() == digest and bob.limits == Limits()


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('[keys.a]\nkey = "k"\nrequest_per_minute = 3\n', "unknown fields ['request_per_minute']"),
        ("[keys.a]\nrequests_per_minute = 3\n", "exactly one of key or key_sha256"),
        ('[keys.a]\nkey = "k"\nkey_sha256 = "00"\n', "exactly one of key or key_sha256"),
        ('[keys.a]\nkey_sha256 = "abc"\n', "64 hex digits"),
        ('[keys.a]\nkey = "k"\ntokens_per_minute = 0\n', "tokens_per_minute must be a positive integer"),
        ('[keys.a]\nkey = "k"\ntokens_per_minute = "lots"\n', "tokens_per_minute must be a positive integer"),
        ('[keys.a]\nkey = "k"\n[keys.b]\nkey = "k"\n', "'a' and 'b' have the same key"),
        ('[keys."a b"]\nkey = "k"\n', "a name is 1-64 letters"),
        ('[key.a]\nkey = "k"\n', "unknown top-level entries ['key']"),
        ("[keys.a\n", "not valid TOML"),
    ],
)
def test_a_bad_key_file_is_refused_naming_what_to_change(tmp_path, text, says):
    with pytest.raises(KeyFileError) as exc:
        load_key_file(write(tmp_path, text))
    assert says in str(exc.value)


def test_an_empty_key_file_does_not_open_the_server(tmp_path):
    with pytest.raises(KeyFileError, match="no keys"):
        Keyring(file=write(tmp_path, ""))


def test_flag_keys_and_file_keys_work_side_by_side(tmp_path):
    ring = Keyring(["sk-1", "sk-2"], write(tmp_path, '[keys.alice]\nkey = "sk-a"\n'))
    assert [ring.identify(k).name for k in ("sk-1", "sk-2", "sk-a")] == ["api-key-1", "api-key-2", "alice"]


def test_a_wrong_key_is_nobody(tmp_path):
    ring = Keyring(file=write(tmp_path, '[keys.alice]\nkey = "sk-a"\n'))
    assert ring.identify("sk-b") is None
    assert ring.identify("") is None


def test_without_keys_everyone_is_the_anonymous_unlimited_key():
    key = Keyring().identify("anything")
    assert key.name == ANONYMOUS and key.quota.unlimited


def test_a_failed_reload_keeps_the_keys_in_use(tmp_path):
    path = write(tmp_path, '[keys.alice]\nkey = "sk-a"\n')
    ring = Keyring(file=path)
    path.write_text('[keys.alice]\nkey = "sk-a"\nbogus = 1\n')
    with pytest.raises(KeyFileError):
        ring.reload()
    assert ring.identify("sk-a").name == "alice"


def test_reload_picks_up_a_rotated_key(tmp_path):
    path = write(tmp_path, '[keys.alice]\nkey = "sk-old"\n')
    ring = Keyring(file=path)
    path.write_text('[keys.alice]\nkey = "sk-new"\n')
    ring.reload()
    assert ring.identify("sk-old") is None
    assert ring.identify("sk-new").name == "alice"
