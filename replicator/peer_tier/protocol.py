"""The peer tier's wire protocol between node agents: URL paths and the upload header.

The server is ``replicator.peer_tier.service`` (its docstring gives each route's body and statuses); the
client is ``replicator.peer_tier.client`` (restores pull from peers, the save path pushes replicas). Both
take the names from here, so neither imports the other. Every route requires
``Authorization: Bearer <token>`` (``replicator.wire.bearer``).
"""

import re

# Paths are both aiohttp route templates and ``str.format`` templates.
JOB_PATH = "/v1/peer/jobs/{namespace}/{job}"
STEPS_PATH = JOB_PATH + "/steps"  # GET: the steps this node holds for the job
STEP_PATH = JOB_PATH + "/ranks/{rank}/steps/{step}"
MANIFEST_SUFFIX = "/manifest"  # GET: the step's StepManifest JSON
FILES_SUFFIX = "/files/"  # + a relative posix path: GET (honours Range) or PUT one file of a push
SHARD_SUFFIX = "/parity/"  # + a stripe: GET (honours Range) a parity shard; {rank} is the group's first member
SHARD_CRC_HEADER = "X-MTC-Shard-CRC32C"  # a served shard's CRC-32C, 8 hex digits
COMMIT_SUFFIX = "/commit"  # POST the manifest: verify a push and install it as a replica

# A push names its upload with this header on every PUT and on the commit; the client picks the id.
UPLOAD_HEADER = "X-MTC-Upload"
UPLOAD_ID = re.compile(r"^[0-9a-f]{16,64}$")
# ... and declares the step's total bytes on every PUT: the receiver refuses a step that would not fit
# beside the job's next save before any byte of it is written (``replicator.local_tier.space``).
STEP_BYTES_HEADER = "X-MTC-Step-Bytes"
