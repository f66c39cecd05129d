"""The node agent's peer side: other nodes list, fetch and push committed steps over HTTP.

Routes under ``/v1/peer/jobs/{namespace}/{job}`` (JSON; errors are ``{"error": "..."}``), each one
requiring ``Authorization: Bearer <token>`` (401 otherwise); paths and header names are in
``replicator.peer_tier.protocol``, shared with the client (``replicator.peer_tier.client``):

- ``GET  .../steps``: ``{"steps": [{"rank", "step", "bytes"}]}``, own steps and replicas.
- ``GET  .../ranks/{rank}/steps/{step}/manifest``: the step's ``StepManifest`` JSON.
- ``GET  .../ranks/{rank}/steps/{step}/files/{path}``: one file of the manifest; honours ``Range``.
  A 404 from these two proves the node no longer holds the copy (the fetching node never tries it
  again), so a lookup that met the step's directory being moved is made again before it is sent.
- ``GET  .../ranks/{group}/steps/{step}/parity/{stripe}``: a parity shard (``replicator.local_tier.parity_shards``)
  of the group whose first member is ``group``; honours ``Range``; its CRC-32C in ``X-MTC-Shard-CRC32C``.
- ``PUT  .../ranks/{rank}/steps/{step}/files/{path}``: one file of a replica push, with header
  ``X-MTC-Upload: <hex id>`` chosen by the client and ``X-MTC-Step-Bytes: <the step's total bytes>``;
  the body streams into that upload's incoming dir. 201 ``{"bytes": n}``; 507 when it does not fit on
  the ramdisk, and already on the upload's first PUT when the whole step would not fit beside the job's
  next save and the other uploads in progress (``replicator.local_tier.space``). Any failed PUT
  discards the upload (410 for its later PUTs).
- ``POST .../ranks/{rank}/steps/{step}/commit``: body = the manifest, same header. Verifies the upload
  against it and only then installs it as a replica: 200 ``{"rank", "step", "bytes"}``, or 422
  ``{"error", "problems": [...]}`` and the upload is deleted. A half-received replica is never visible.

Nothing outside the job's ramdisk is read or written: names are validated (400), a served file must
resolve inside its step directory, and the step directory inside the ramdisk. Upload bodies stream to
disk and the commit body has its own cap, so the app's ``client_max_size`` needs no change.
"""

import asyncio
import dataclasses
import errno
import os
import shutil
import time
from collections.abc import Callable
from typing import overload

import tenacity
from aiohttp import web

from csi_driver.volume_request import DNS1123_LABEL
from replicator.local_tier import pod_files, space
from replicator.local_tier.job_meta import JobMeta
from replicator.local_tier.parity_shards import ParityShards
from replicator.local_tier.step_manifest import StepManifest, safe_relpath, verify_step
from replicator.pacing.cpu_share import CpuShare
from replicator.peer_tier.grant_check import PeerGrants, refuse_listing, require_grant
from replicator.peer_tier.params import int_param
from replicator.peer_tier.protocol import (
    COMMIT_SUFFIX,
    FILES_SUFFIX,
    MANIFEST_SUFFIX,
    SHARD_CRC_HEADER,
    SHARD_SUFFIX,
    STEP_BYTES_HEADER,
    STEP_PATH,
    STEPS_PATH,
    UPLOAD_HEADER,
    UPLOAD_ID,
)
from replicator.wire.bearer import Handler, Tokens, require_bearer
from replicator.wire.grants import Operation
from replicator.wire.http_errors import error_response

# (namespace, job, bytes wanted free, step to keep) -> None: ``NodeReplicator.make_room`` for that job's
# ramdisk, keeping the step being received (a push is of the replication round's step, which the node's
# last retain order may not protect yet).
MakeRoom = Callable[[str, str, int, int], None]

_MAX_MANIFEST_BYTES = 16 << 20
_RECEIVE_CHUNK_BYTES = 1 << 20
_UPLOAD_IDLE_SECONDS = 600.0  # an upload untouched this long was abandoned by its client
# A held step's directory moves: a restore stages it (committed -> staged name, in a thread of this
# agent), Orbax takes the marker (back), a set-aside step is moved into place. Each move is one
# atomic rename, so a lookup that ran into one finds the step when made again a moment later.
_LOOKUP_ATTEMPTS = tenacity.stop_after_attempt(3)
_LOOKUP_WAIT = tenacity.wait_fixed(0.05)  # seconds between lookups


@dataclasses.dataclass(frozen=True)
class _StepRef:
    """A request's job and (rank, step), parsed and with the job's ramdisk found."""

    ramdisk: str
    meta: JobMeta
    rank: int
    step: int


@dataclasses.dataclass
class _Upload:
    """A replica push in progress: files land in ``directory`` until the commit."""

    directory: str
    target: tuple[str, int, int]  # (ramdisk, rank, step)
    declared: int = 0  # the step's total bytes, as the client declared them
    written: int = 0  # bytes received so far
    active: int = 0
    last_used: float = dataclasses.field(default_factory=time.monotonic)
    discarded: bool = False


class _Uploads:
    """Uploads by client-chosen id.

    A failed PUT discards its upload: the files are deleted once no PUT still writes into them, and
    the id is kept, so the client's other PUTs of that upload are refused instead of starting over.
    Ids untouched for ``_UPLOAD_IDLE_SECONDS`` are forgotten (and their files deleted) when the next
    upload starts.
    """

    def __init__(self):
        self._by_id: dict[str, _Upload] = {}

    def acquire(self, upload_id: str, ref: _StepRef, declared: int) -> _Upload:
        """The upload for a PUT (created on first use, if the step's ``declared`` bytes fit); pair with ``release``."""
        upload = self._by_id.get(upload_id)
        if upload is None:
            self._forget_idle()
            self._check_room(ref, declared)
            upload = self._by_id[upload_id] = _Upload(
                ref.meta.new_incoming_dir(), (ref.ramdisk, ref.rank, ref.step), declared
            )
        elif upload.discarded:
            raise error_response(
                web.HTTPGone, f"upload {upload_id} was discarded after an error; push again with a new id"
            )
        elif upload.target != (ref.ramdisk, ref.rank, ref.step):
            raise error_response(web.HTTPConflict, f"upload {upload_id} belongs to another job, rank or step")
        upload.active += 1
        return upload

    def known(self, upload_id: str) -> bool:
        return upload_id in self._by_id

    def room_needed(self, ref: _StepRef, declared: int) -> tuple[int, int]:
        """(bytes a new upload of ``declared`` bytes needs free: itself, the job's next save and what
        other uploads to the ramdisk still have to write; the part of it that is the next save's)."""
        kept = space.next_save_bytes(ref.meta)
        pending = sum(
            max(0, u.declared - u.written)
            for u in self._by_id.values()
            if u.target[0] == ref.ramdisk and not u.discarded
        )
        return declared + kept + pending, kept

    def _check_room(self, ref: _StepRef, declared: int) -> None:
        """Refuses (507) a new upload of ``declared`` bytes that does not fit (``room_needed``)."""
        (needed, kept), free = self.room_needed(ref, declared), space.free_bytes(ref.ramdisk)
        if needed > free:
            raise error_response(
                web.HTTPInsufficientStorage,
                f"rank {ref.rank} step {ref.step} ({declared} bytes) does not fit: the ramdisk has"
                f" {free} bytes free, keeps {kept} for the job's next save and {needed - declared - kept} for uploads"
                f" in progress",
            )

    def release(self, upload: _Upload) -> None:
        upload.active -= 1
        upload.last_used = time.monotonic()
        if upload.discarded and upload.active == 0:
            shutil.rmtree(upload.directory, ignore_errors=True)

    def discard(self, upload: _Upload) -> None:
        upload.discarded = True
        if upload.active == 0:
            shutil.rmtree(upload.directory, ignore_errors=True)

    def take(self, upload_id: str, ref: _StepRef) -> _Upload:
        """Removes a finished upload for its commit; the caller installs or deletes its directory."""
        upload = self._by_id.get(upload_id)
        if upload is None or upload.discarded or upload.target != (ref.ramdisk, ref.rank, ref.step):
            raise error_response(web.HTTPNotFound, f"no upload {upload_id} for rank {ref.rank} step {ref.step}")
        if upload.active:
            raise error_response(web.HTTPConflict, f"upload {upload_id} still has {upload.active} files being received")
        del self._by_id[upload_id]
        return upload

    def _forget_idle(self) -> None:
        now = time.monotonic()
        for upload_id, upload in list(self._by_id.items()):
            if upload.active == 0 and now - upload.last_used > _UPLOAD_IDLE_SECONDS:
                del self._by_id[upload_id]
                shutil.rmtree(upload.directory, ignore_errors=True)


def _path_param(request: web.Request) -> str:
    try:
        return safe_relpath(request.match_info["path"])
    except ValueError as err:
        raise error_response(web.HTTPBadRequest, str(err)) from None


def _upload_id(request: web.Request) -> str:
    value = request.headers.get(UPLOAD_HEADER, "")
    if not UPLOAD_ID.match(value):
        raise error_response(web.HTTPBadRequest, f"header {UPLOAD_HEADER} must be 16-64 lowercase hex digits")
    return value


def _declared_bytes(request: web.Request) -> int:
    """The push's ``X-MTC-Step-Bytes`` (0 when a client sends none: each file is then checked alone)."""
    value = request.headers.get(STEP_BYTES_HEADER, "0")
    if not (value.isascii() and value.isdigit() and len(value) <= 20):
        raise error_response(web.HTTPBadRequest, f"header {STEP_BYTES_HEADER} must be a non-negative integer")
    return int(value)


def _open_inside(step_dir: str, rel: str) -> int:
    """Opens ``step_dir/rel`` for reading when every component is a real directory and the file a
    regular file (``pod_files``: no symlink is followed, a FIFO never blocks).

    Raises:
      HTTPBadRequest: a component is a symlink or the file is not regular.
      HTTPNotFound: it cannot be opened (missing, a parent that is not a directory).
    """
    try:
        with pod_files.open_dir(step_dir) as root:
            return pod_files.open_relative(root, rel)
    except pod_files.UnsafeEntry as err:
        raise error_response(
            web.HTTPBadRequest, f"{rel} is not a regular file inside the step directory: {err}"
        ) from None
    except OSError as err:
        raise error_response(web.HTTPNotFound, f"{rel} is listed but cannot be opened: {err.strerror}") from None


class _DescriptorFileResponse(web.FileResponse):
    """Serves an open, checked descriptor through ``/proc/self/fd`` (FileResponse does Range and
    sendfile) and closes it once sent; aiohttp prepares a returned response exactly once."""

    def __init__(self, fd: int):
        super().__init__(f"/proc/self/fd/{fd}")
        self._fd = fd

    async def prepare(self, request: web.BaseRequest):
        try:
            return await super().prepare(request)
        finally:
            os.close(self._fd)


async def _read_manifest(request: web.Request, ref: _StepRef) -> StepManifest:
    """The commit body: a manifest of this rank and step whose paths are all safe (else 400/413)."""
    body = bytearray()
    async for chunk in request.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > _MAX_MANIFEST_BYTES:
            raise error_response(
                web.HTTPRequestEntityTooLarge,
                f"manifest over {_MAX_MANIFEST_BYTES} bytes",
                max_size=_MAX_MANIFEST_BYTES,
                actual_size=len(body),
            )
    try:
        manifest = StepManifest.from_json(body.decode())
        for rel in manifest.files:
            safe_relpath(rel)
    except (ValueError, KeyError, TypeError) as err:
        raise error_response(web.HTTPBadRequest, f"body is not a valid manifest: {err}") from None
    if (manifest.rank, manifest.step) != (ref.rank, ref.step):
        raise error_response(
            web.HTTPBadRequest,
            f"manifest is for rank {manifest.rank} step {manifest.step}, not rank {ref.rank} step {ref.step}",
        )
    return manifest


async def _receive(request: web.Request, path: str, share: CpuShare | None) -> int:
    """Streams the request body into a new file at ``path``, pausing for ``share``; returns its size, bytes."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    written = 0
    with open(path, "wb", buffering=0) as f:  # noqa: ASYNC230  # a tmpfs file: each write is a memory copy
        async for chunk in request.content.iter_chunked(_RECEIVE_CHUNK_BYTES):
            f.write(chunk)  # unbuffered file: write() writes it all or raises
            written += len(chunk)
            if share is not None:
                await share.wait()
    return written


class _PeerService:
    """The handlers, sharing the job lookup and the uploads in progress."""

    def __init__(
        self, locate_ramdisk: Callable[[str, str], str | None], share: CpuShare | None, make_room: MakeRoom | None
    ):
        self._locate_ramdisk = locate_ramdisk
        self._share = share
        self._make_room = make_room
        self._uploads = _Uploads()
        self._install_lock = asyncio.Lock()  # install_replica of the same (rank, step) must not interleave

    def _job(self, request: web.Request) -> tuple[str, JobMeta]:
        namespace, job = request.match_info["namespace"], request.match_info["job"]
        for name, value in (("namespace", namespace), ("job", job)):
            if not DNS1123_LABEL.match(value):
                raise error_response(web.HTTPBadRequest, f"{name} {value!r} is not a DNS-1123 label")
        ramdisk = self._locate_ramdisk(namespace, job)
        if ramdisk is None:
            raise error_response(web.HTTPNotFound, f"job {namespace}/{job} has no ramdisk on this node")
        return ramdisk, JobMeta(ramdisk)

    def _step_ref(self, request: web.Request) -> _StepRef:
        rank, step = int_param(request, "rank"), int_param(request, "step")
        return _StepRef(*self._job(request), rank, step)

    @overload
    async def _looked_up(self, ref: _StepRef) -> tuple[StepManifest, None]: ...

    @overload
    async def _looked_up(self, ref: _StepRef, rel: str) -> tuple[StepManifest, int]: ...

    async def _looked_up(self, ref: _StepRef, rel: str | None = None) -> tuple[StepManifest, int | None]:  # type: ignore[return]  # tenacity re-raises the last attempt's error
        """The step's manifest and, given ``rel``, an open descriptor of that file of it.

        Raises:
          HTTPNotFound: the step or the file is not held here, in three lookups 50 ms apart.
          HTTPBadRequest: ``rel`` is not a regular file inside the step directory.
        """
        async for attempt in tenacity.AsyncRetrying(
            stop=_LOOKUP_ATTEMPTS,
            wait=_LOOKUP_WAIT,
            reraise=True,
            retry=tenacity.retry_if_exception_type(web.HTTPNotFound),
        ):
            with attempt:
                found = ref.meta.locate(ref.rank, ref.step)
                if found is None:
                    raise error_response(web.HTTPNotFound, f"rank {ref.rank} step {ref.step} is not held here")
                step_dir, manifest = found
                if rel is None:
                    return manifest, None
                if rel not in manifest.files:
                    raise error_response(web.HTTPNotFound, f"{rel} is not a file of rank {ref.rank} step {ref.step}")
                return manifest, _open_inside(step_dir, rel)

    async def list_steps(self, request: web.Request) -> web.Response:
        _, meta = self._job(request)
        framework = meta.framework
        held = {
            (m.rank, m.step): m.total_bytes
            for m in meta.manifests().values()
            if framework.find_step_dir(meta.client_dir, m.step) is not None
        }
        held.update({key: m.total_bytes for key, m in meta.replicas().items()})
        return web.json_response({"steps": [{"rank": r, "step": s, "bytes": n} for (r, s), n in sorted(held.items())]})

    async def get_manifest(self, request: web.Request) -> web.Response:
        manifest, _ = await self._looked_up(self._step_ref(request))
        return web.Response(text=manifest.to_json(), content_type="application/json")

    async def get_file(self, request: web.Request) -> web.StreamResponse:
        _, fd = await self._looked_up(self._step_ref(request), _path_param(request))
        return _DescriptorFileResponse(fd)

    async def get_shard(self, request: web.Request) -> web.StreamResponse:
        ref, stripe = self._step_ref(request), int_param(request, "stripe")
        shards = ParityShards(ref.ramdisk)
        meta = shards.meta(ref.step, ref.rank, stripe)
        if meta is None:
            raise error_response(
                web.HTTPNotFound, f"stripe {stripe} of group {ref.rank} step {ref.step} is not held here"
            )
        try:
            fd = os.open(shards.path(ref.step, ref.rank, stripe), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as err:
            raise error_response(web.HTTPNotFound, f"the shard cannot be opened: {err.strerror}") from None
        response = _DescriptorFileResponse(fd)
        response.headers[SHARD_CRC_HEADER] = meta.crc32c
        return response

    async def put_file(self, request: web.Request) -> web.Response:
        ref, rel, upload_id, declared = (
            self._step_ref(request),
            _path_param(request),
            _upload_id(request),
            _declared_bytes(request),
        )
        if self._make_room is not None and not self._uploads.known(upload_id):
            needed, _ = self._uploads.room_needed(ref, declared)
            if needed > space.free_bytes(ref.ramdisk):
                await asyncio.to_thread(
                    self._make_room, request.match_info["namespace"], request.match_info["job"], needed, ref.step
                )
        free = space.free_bytes(ref.ramdisk)
        upload = self._uploads.acquire(upload_id, ref, declared)
        try:
            if request.content_length is not None and request.content_length > free:
                raise OSError(errno.ENOSPC, "Content-Length exceeds free space")  # handled as a full disk below
            written = await _receive(request, os.path.join(upload.directory, rel), self._share)
            upload.written += written
        except BaseException as err:
            self._uploads.discard(upload)
            if isinstance(err, OSError) and err.errno == errno.ENOSPC:
                raise error_response(
                    web.HTTPInsufficientStorage,
                    f"{rel} does not fit: {request.content_length} bytes sent, the ramdisk"
                    f" had {free} bytes free; upload {upload_id} discarded",
                ) from None
            if isinstance(err, (IsADirectoryError, NotADirectoryError, FileExistsError)):
                raise error_response(
                    web.HTTPConflict, f"{rel} clashes with another path of upload {upload_id}; upload discarded"
                ) from None
            raise
        finally:
            self._uploads.release(upload)
        return web.json_response({"bytes": written}, status=201)

    async def commit(self, request: web.Request) -> web.Response:
        ref, upload_id = self._step_ref(request), _upload_id(request)
        manifest = await _read_manifest(request, ref)
        upload = self._uploads.take(upload_id, ref)
        try:
            problems = await asyncio.to_thread(verify_step, upload.directory, manifest, self._share)
            if not problems:
                async with self._install_lock:
                    await asyncio.to_thread(ref.meta.install_replica, upload.directory, manifest)
        finally:
            if os.path.exists(upload.directory):  # noqa: ASYNC240  # one stat; not installed: verification failed or raised
                await asyncio.to_thread(shutil.rmtree, upload.directory, True)
        if problems:
            raise error_response(
                web.HTTPUnprocessableEntity, f"upload {upload_id} does not match its manifest; discarded", problems
            )
        return web.json_response({"rank": ref.rank, "step": ref.step, "bytes": manifest.total_bytes})


def add_peer_routes(
    app: web.Application,
    locate_ramdisk: Callable[[str, str], str | None],
    tokens: Tokens,
    share: CpuShare | None = None,
    make_room: MakeRoom | None = None,
    grants: PeerGrants | None = None,
) -> None:
    """Adds the ``/v1/peer`` routes to the node agent's app.

    Args:
      app: the node agent's aiohttp application, not yet started.
      locate_ramdisk: ``(namespace, job) -> ramdisk path``, or None when the job has none on this node.
        Called with validated DNS-1123 labels only.
      tokens: the shared peer secrets: every request must present one as ``Authorization: Bearer <token>``
        (a rotation in the token file takes effect on the next request).
      share: the agent's CPU cap for receiving and verifying replicas (not for serving restores), or None.
      make_room: called (in a thread) before a replica that does not fit is refused: it may give up
        unsafe copies of the job (``replicator.local_tier.space``); or None.
      grants: with ``--peer-grants``, every route also needs the coordinator's grant for its copy
        (``replicator.peer_tier.grant_check``); None serves on the token alone.
    """
    service = _PeerService(locate_ramdisk, share, make_room)

    def guarded(handler: Handler, *allowed: Operation) -> Handler:
        """The token first (401), then the grant (403): an unknown caller learns nothing of grants."""
        if grants is not None:
            handler = require_grant(handler, allowed, grants) if allowed else refuse_listing(handler)
        return require_bearer(handler, tokens)

    app.add_routes(
        [
            web.get(STEPS_PATH, guarded(service.list_steps)),
            web.get(STEP_PATH + MANIFEST_SUFFIX, guarded(service.get_manifest, "fetch", "push")),
            web.get(STEP_PATH + FILES_SUFFIX + "{path:.+}", guarded(service.get_file, "fetch")),
            web.get(STEP_PATH + SHARD_SUFFIX + "{stripe}", guarded(service.get_shard, "parity")),
            web.put(STEP_PATH + FILES_SUFFIX + "{path:.+}", guarded(service.put_file, "push")),
            web.post(STEP_PATH + COMMIT_SUFFIX, guarded(service.commit, "push")),
        ]
    )
