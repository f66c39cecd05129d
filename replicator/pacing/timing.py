"""Every timing constant of the node agent, in seconds, each with why it has its value.

The defaults of ``NodeConfig`` fields an operator may need to change (``mtc node`` flags) are
marked *flag*. Constants kept elsewhere, on purpose:

- ``csi_driver.file_cache.RACY_SECONDS`` (1 s): ``csi_driver`` imports nothing from ``replicator``.
- ``replicator.wire.messages.MAX_WAIT_SECONDS`` (20 s): the long-poll bound both processes share.
- ``replicator.backup_tier.worker`` (listing every 120 s, retries 2-60 s), the backup backends' HTTP
  timeouts (``gcs_backup``, ``s3_backup``) and ``replicator.peer_tier.service``'s 600 s abandoned-upload
  age: each belongs to the one module that uses it.
- The coordinator's ``--node-timeout-seconds`` (15 s) and ``--holder-grace-seconds`` (60 s) are
  flags of ``mtc coordinator``.
"""

# Orbax waits 300 s for the restore marker (``local_tier.frameworks.orbax``); the restore gives up 30 s before,
# so the job is told why in ``replicator.errors`` instead of timing out silently. *flag*
RESTORE_DEADLINE_SECONDS = 270.0

# A loop that has not completed a pass for this long is wedged: /healthz and CSI Probe say so, and
# the DaemonSet's livenessprobe restarts the agent. Well above the longest legitimate pass (a 10 s
# report timeout plus GC of a few steps). *flag*
WEDGED_AFTER_SECONDS = 120.0

# At most one push per job and peer this often: a job saving faster replicates one step per round (the
# coordinator's, replicas.py), so the agent's CPU use stays bounded however often the job saves. *flag*
MIN_PUSH_INTERVAL_SECONDS = 2.0

# The agent keeps its connection to the coordinator open this long between requests: longer than
# the slowest heartbeat the coordinator asks for (10 s at 10,000 nodes) plus lag, or every report
# pays a new TCP and TLS handshake at both ends (aiohttp's default is 15 s).
COORDINATOR_KEEPALIVE_SECONDS = 60.0

# The report loop looks for changes this often; a report goes out only on a change, a poke or a
# heartbeat (whose pace the coordinator sets), so this is the latency of a missed poke.
ROUND_INTERVAL_SECONDS = 1.0

# One pass over a job's ramdisk (hand-shake files, commits) this often: a fifth of a second of
# latency on Orbax's polls, while an unchanged job costs a few stats per pass (``file_cache``).
WATCH_INTERVAL_SECONDS = 0.2

# An unusable replicator.yaml is refused only once it stayed unchanged this long: the Resiliency library
# writes it in place, so a pass may read it empty (for 0.4 ms on an idle node; 0.1 s stalls were seen to
# fail every start). 25 passes, far above any stall between create and write, and the job waits 300 s for
# the file to go; a file that is truly bad is refused this much later, one that validates at once.
CONFIG_SETTLE_SECONDS = 5.0

# One coordinator request (beyond a long poll's own wait): the coordinator answers from memory, so
# anything slower is an outage: the report is retried after a backoff (below).
REQUEST_TIMEOUT_SECONDS = 10.0

# A report that failed (the coordinator overloaded, restarting or unreachable) goes again after this
# long, doubling per failure up to the max, jittered (``ReportSession.failed``). The max is the
# slowest heartbeat (10,000 nodes): 10,000 agents retrying at once offer the coordinator what their
# heartbeats do, instead of 10,000 TLS handshakes a second; a restarted coordinator hears from every
# agent within it.
REPORT_RETRY_FIRST_SECONDS = 1.0
REPORT_RETRY_MAX_SECONDS = 10.0

# Whole steps move over the peer session, so it has no total timeout; connecting and every read are
# bounded, so a frozen peer fails the transfer instead of hanging it.
PEER_CONNECT_TIMEOUT_SECONDS = 10.0
PEER_READ_TIMEOUT_SECONDS = 60.0

# The same error (per key) is logged and reported to the job's ``replicator.errors`` at most this
# often: Orbax logs every line it reads, and a retry loop would flood it.
ERROR_REPEAT_SECONDS = 30.0

# An unreachable restore source (a restarting agent, a frozen node, a network blip) is retried with
# this exponential backoff for as long as Orbax waits; only a proven mismatch gives a copy up.
RESTORE_RETRY_FIRST_SECONDS = 1.0
RESTORE_RETRY_MAX_SECONDS = 10.0
# The coordinator did not answer for the restore plan: a restarting coordinator is back within a few
# seconds, and the deadline above bounds the whole wait.
RESTORE_PLAN_RETRY_SECONDS = 1.0

# A rank whose identical peer's node downloads their step from the backup tier (read-once restore)
# waits this long for it before reading the store itself: a node that is slow or stuck costs at most
# this much, one that dies stops the wait at once (the coordinator sees it silent). About what one
# node's download of a large shard takes, and well inside the deadline above.
FAN_OUT_WAIT_SECONDS = 60.0

# For this long after a push succeeded, an order to repeat it first asks the target for its manifest:
# the coordinator learns of the push only from the target's next report (a heartbeat or two).
PUSH_REPEAT_SECONDS = 30.0

# Backup orders are repeated with every reply: one missing from three heartbeats was withdrawn, but
# never sooner than this (a fast heartbeat must not cancel an order between two replies).
MIN_BACKUP_ORDER_TTL_SECONDS = 10.0

# Idle ramdisks are looked for this often; their retention (``--retention-seconds``, a day by
# default) is so long that half a minute of lateness does not matter.
REAP_INTERVAL_SECONDS = 30.0

# Kubelet's in-flight calls get this long to finish when the agent stops.
CSI_STOP_GRACE_SECONDS = 5.0
