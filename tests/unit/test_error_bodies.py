"""The JSON error body both services answer with reads back as the message it was built from, and the
TLS flags of both processes are refused alone (``replicator.wire.http_errors``, ``replicator.wire.tls``)."""

import json

import pytest
from aiohttp import web

from replicator.wire import tls
from replicator.wire.http_errors import error_of, error_response


def test_an_error_body_reads_back_as_its_message_and_problems():
    plain = error_response(web.HTTPNotFound, "rank 3 step 8 is not held here")
    assert plain.status == 404 and plain.content_type == "application/json"
    assert json.loads(plain.text) == {"error": "rank 3 step 8 is not held here"}
    assert error_of(plain.text.encode()) == "rank 3 step 8 is not held here"
    listed = error_response(
        web.HTTPUnprocessableEntity, "upload u does not match", ["a: crc32c mismatch", "missing file b"]
    )
    assert json.loads(listed.text)["problems"] == ["a: crc32c mismatch", "missing file b"]
    assert error_of(listed.text) == "upload u does not match; a: crc32c mismatch; missing file b"
    unauthorized = error_response(
        web.HTTPUnauthorized, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
    )
    assert unauthorized.headers["WWW-Authenticate"] == "Bearer"


@pytest.mark.parametrize("body", [b"<html>502 Bad Gateway</html>", b'["error"]', b'{"message": "x"}', b"\xff\xfe"])
def test_a_body_that_is_not_an_error_body_reads_as_its_start(body):
    assert error_of(body + b"." * 1000) == (body + b"." * 1000).decode("utf-8", "replace")[:500]


def test_a_certificate_without_its_key_is_refused_and_both_or_neither_pass():
    with pytest.raises(ValueError, match="^--tls-cert and --tls-key go together$"):
        tls.check_pair("cert.pem", None, "--tls-cert and --tls-key")
    with pytest.raises(ValueError, match="go together"):
        tls.check_pair(None, "key.pem", "--tls-cert and --tls-key")
    tls.check_pair(None, None, "--tls-cert and --tls-key")
    tls.check_pair("cert.pem", "key.pem", "--tls-cert and --tls-key")
    assert tls.server_context(None, None) is None and tls.client_context(None) is None
