"""The cluster token file: several tokens, the first sent and all accepted, read again when the
kubelet swaps the mounted Secret (``replicator.wire.bearer``)."""

import os

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from replicator.wire.bearer import Tokens, read_token, require_bearer
from tests.helpers.secrets import project_secret


def test_the_first_token_is_sent_and_every_token_is_accepted(tmp_path):
    path = tmp_path / "token"
    path.write_text("\n  new-token \n\nold-token\n")
    tokens = Tokens(str(path))
    assert tokens.current == "new-token"
    assert tokens.header() == {"Authorization": "Bearer new-token"}
    assert tokens.accepts("new-token") and tokens.accepts("old-token")
    assert not tokens.accepts("other") and not tokens.accepts("") and not tokens.accepts("new-token\nold-token")
    assert read_token(str(path)) == "new-token"


def test_each_stage_of_a_rotation_is_seen_on_the_next_use(tmp_path):
    path = tmp_path / "token"
    path.write_text("old\n")
    tokens = Tokens(str(path))
    seen = []
    for text in ("old\nnew\n", "new\nold\n", "new\n"):
        project_secret(path, text)
        seen.append((tokens.current, tokens.accepts("old"), tokens.accepts("new")))
    assert seen == [("old", True, True), ("new", True, True), ("new", False, True)]


def test_an_unusable_rewrite_keeps_the_tokens_last_read_until_a_good_one(tmp_path, caplog):
    path = tmp_path / "token"
    path.write_text("old\n")
    tokens = Tokens(str(path))
    project_secret(path, "\n \n")
    assert os.path.islink(path)
    assert tokens.current == "old" and tokens.accepts("old")
    assert tokens.current == "old"
    assert [r.getMessage() for r in caplog.records].count(
        f"token file {path} changed but cannot be used, keeping its previous 1 token(s): token file {path} is empty"
    ) == 1  # logged once per change
    os.unlink(path)  # gone for a moment
    assert tokens.current == "old"
    project_secret(path, "new\n")
    assert tokens.current == "new" and not tokens.accepts("old")


@pytest.mark.parametrize(
    "text, error", [("", "is empty"), ("a b\n", "token 1 holds white space"), ("ok\nnon-ascii-é\n", "token 2 holds")]
)
def test_a_bad_token_file_is_refused_at_start_naming_the_file(tmp_path, text, error):
    path = tmp_path / "token"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=error) as err:
        Tokens(str(path))
    assert str(path) in str(err.value)


def test_a_missing_token_file_is_an_os_error():
    with pytest.raises(FileNotFoundError):
        Tokens("/nonexistent/token")


async def test_a_guarded_route_accepts_every_token_of_the_file_and_refuses_others(tmp_path):
    path = tmp_path / "token"
    path.write_text("old\n")
    tokens = Tokens(str(path))

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    guarded = require_bearer(ok, tokens)

    async def status(value: str | None) -> int:
        try:
            return (
                await guarded(
                    make_mocked_request("GET", "/", headers={"Authorization": value} if value is not None else {})
                )
            ).status
        except web.HTTPException as err:
            return err.status

    assert [await status(v) for v in ("Bearer old", "Bearer new", None, "Basic old", "Bearer  old")] == [
        200,
        401,
        401,
        401,
        401,
    ]
    project_secret(path, "new\nold\n")
    assert [await status(v) for v in ("Bearer old", "Bearer new")] == [200, 200]
    project_secret(path, "new\n")
    assert [await status(v) for v in ("Bearer old", "Bearer new")] == [401, 200]
