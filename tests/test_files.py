"""The Files API through the OpenAI SDK against a real server: upload (streamed, capped), list, retrieve, content,
delete, and files belonging to the key that uploaded them."""

from __future__ import annotations

import http.client
import io
import json
import socket

import openai
import pytest
from conftest import Server

CAP = 64 * 1024
KEYS = '[keys.alice]\nkey = "sk-alice"\n\n[keys.bob]\nkey = "sk-bob"\n'


@pytest.fixture(scope="module")
def files_server(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text(KEYS)
    data = tmp_path_factory.mktemp("data")
    s = Server("--api-keys-file", str(keys), "--data-dir", str(data), "--max-upload-size", f"{CAP}")
    yield s
    s.stop()


def client(server: Server, key: str = "sk-alice") -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=server.url + "/v1", max_retries=0)


JSONL = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


def upload(c: openai.OpenAI, data: bytes = JSONL, name: str = "requests.jsonl", **kw):
    return c.files.create(file=(name, io.BytesIO(data), "application/jsonl"), purpose="batch", **kw)


def test_an_upload_comes_back_as_the_documented_file_object(files_server):
    c = client(files_server)
    f = upload(c)
    assert f.object == "file" and f.id.startswith("file-")
    assert (f.filename, f.bytes, f.purpose) == ("requests.jsonl", len(JSONL), "batch")
    assert f.expires_at - f.created_at == 7 * 86_400  # the hosted default retention
    assert c.files.retrieve(f.id).model_dump() == f.model_dump()


def test_content_returns_the_bytes_uploaded_as_ndjson(files_server):
    c = client(files_server)
    data = b"".join(JSONL.replace(b'"a"', f'"{i}"'.encode()) for i in range(50))
    f = upload(c, data)
    content = c.files.with_raw_response.content(f.id)
    assert content.headers["content-type"].startswith("application/x-ndjson")
    assert content.content == data
    assert c.files.content(f.id).read() == data


def test_expires_after_sets_the_expiry(files_server):
    f = upload(client(files_server), expires_after={"anchor": "created_at", "seconds": 3600})
    assert f.expires_at - f.created_at == 3600


def test_an_expiry_outside_the_range_is_a_400(files_server):
    with pytest.raises(openai.BadRequestError, match="expires_after.seconds"):
        upload(client(files_server), expires_after={"anchor": "created_at", "seconds": 60})


def test_list_pages_oldest_first_with_after(files_server):
    c = client(files_server, "sk-bob")
    ids = [upload(c, name=f"{i}.jsonl").id for i in range(3)]
    listed = [f.id for f in c.files.list(limit=2)]  # the SDK follows has_more with after=<last id>
    assert listed[-3:] == ids
    page = c.files.list(limit=1, after=ids[0])
    assert [f.id for f in page.data] == [ids[1]] and page.has_more


def test_delete_removes_the_file(files_server):
    c = client(files_server)
    f = upload(c)
    deleted = c.files.delete(f.id)
    assert (deleted.id, deleted.deleted) == (f.id, True)
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(f.id)
    with pytest.raises(openai.NotFoundError):
        c.files.content(f.id)


def test_another_keys_file_is_not_found(files_server):
    f = upload(client(files_server))
    bob = client(files_server, "sk-bob")
    for call in (bob.files.retrieve, bob.files.content, bob.files.delete):
        with pytest.raises(openai.NotFoundError):
            call(f.id)
    assert f.id not in [x.id for x in bob.files.list()]
    assert client(files_server).files.retrieve(f.id).id == f.id  # still there for its owner


def test_a_purpose_other_than_batch_is_a_400(files_server):
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client(files_server).files.create(file=("x.jsonl", io.BytesIO(JSONL)), purpose="fine-tune")


def test_a_file_over_the_cap_is_a_413_and_leaves_nothing(files_server, tmp_path):
    c = client(files_server)
    before = len(c.files.list().data)
    with pytest.raises(openai.APIStatusError) as err:
        upload(c, b"x" * (CAP + 1))
    assert err.value.status_code == 413 and "limit" in err.value.message
    assert len(c.files.list().data) == before


def test_a_chunked_upload_over_the_cap_is_refused_while_it_streams(files_server):
    """No Content-Length: the cap is enforced on the bytes as they arrive."""
    boundary = "b0undary"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'
    ).encode()
    with socket.create_connection(("127.0.0.1", files_server.port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-alice\r\nTransfer-Encoding: chunked\r\n"
            + f"Content-Type: multipart/form-data; boundary={boundary}\r\n\r\n".encode()
        )
        chunk = head + b"y" * (CAP + 1024)
        sock.sendall(
            f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
        )  # never finished: the cap answers first
        reply = http.client.HTTPResponse(sock)
        reply.begin()
        status, body = reply.status, json.loads(reply.read())
    assert status == 413 and body["error"]["code"] == "file_too_large"


def test_an_upload_without_a_file_part_is_a_400(files_server):
    import httpx

    r = httpx.post(
        files_server.url + "/v1/files",
        data={"purpose": "batch"},
        files={"other": ("x", b"1")},
        headers={"Authorization": "Bearer sk-alice"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"
