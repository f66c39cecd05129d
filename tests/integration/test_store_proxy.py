"""The chaos suite's HTTP store (``tests/helpers/backup_stores.GcsStore``): a real fake-gcs-server behind
``UnavailableProxy``, which forwards while the store is up and answers every request 503 during ``gone()``, while
the oracle still reads the emulator directly."""

import json
import urllib.error
import urllib.request

import pytest
from google.api_core import exceptions, retry
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from tests.helpers.backup_stores import GcsStore
from tests.helpers.tools import require_tool

JOB = "chaos-slice"


@pytest.fixture
def store(tmp_path):
    opened = GcsStore(require_tool("fake-gcs-server"), str(tmp_path / "gcs"))
    yield opened
    opened.close()


def _through_proxy(store: GcsStore) -> storage.Bucket:
    """The bucket as the agents reach it: through the proxy."""
    client = storage.Client(
        project="test",
        credentials=AnonymousCredentials(),
        client_options={"api_endpoint": store.env["STORAGE_EMULATOR_HOST"]},
    )
    return client.bucket("ckpt")


def test_uploads_through_the_proxy_reach_the_store_and_the_oracle_reads_commits_and_flips_bytes(store):
    bucket = _through_proxy(store)
    bucket.blob(f"mtc/default/{JOB}/steps/12/rank-0/a").upload_from_string(b"0123456789" * 1000)
    bucket.blob(f"mtc/default/{JOB}/steps/12/COMMIT").upload_from_string(b"{}")
    bucket.blob(f"mtc/default/{JOB}/steps/18-t1/rank-0/a").upload_from_string(b"x")  # no COMMIT: not committed

    assert set(store.commits(JOB)) == {"12"}
    assert store.exists(JOB, "12/rank-0/a") and not store.exists(JOB, "18-t1/COMMIT")
    store.flip(JOB, "12/rank-0/a")
    data = bucket.blob(f"mtc/default/{JOB}/steps/12/rank-0/a").download_as_bytes()
    assert len(data) == 10000 and data[5000] == ord("0") ^ 0xFF and data[:5000] == (b"0123456789" * 500)


def test_while_gone_every_request_answers_503_with_a_json_body_and_then_the_store_is_back(store):
    bucket = _through_proxy(store)
    bucket.blob("mtc/before").upload_from_string(b"kept")
    with store.gone():
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(store.proxy.url + "/storage/v1/b/ckpt/o", timeout=10)
        assert refused.value.code == 503 and json.load(refused.value)["error"]["code"] == 503
        with pytest.raises(exceptions.ServiceUnavailable):  # an upload with its body, answered after it is read
            bucket.blob("mtc/during").upload_from_string(b"y" * 100_000, retry=None)
        assert store.proxy.refused == 2
        assert store.commits(JOB) == {} and store.bucket.blob("mtc/before").exists()  # the oracle reads the emulator
    assert bucket.blob("mtc/before").download_as_bytes(retry=retry.Retry(timeout=10)) == b"kept"
    assert not bucket.blob("mtc/during").exists()
