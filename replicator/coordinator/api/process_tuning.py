"""The coordinator's process, tuned for thousands of keep-alive connections: its open-file limit, its
garbage collector, and one TLS read buffer for every connection (``tls_read_buffer``)."""

import gc
import logging
import resource

from replicator.coordinator.api.tls_read_buffer import share_tls_read_buffer

log = logging.getLogger(__name__)

# The garbage collector. What a collection visits is mostly what the last request on each keep-alive
# connection left alive: aiohttp keeps a connection's last request and response (about 60 objects)
# until its next request, 10 s at 10,000 nodes. Those objects outlive two collections and die in the
# old generation, and each death takes one off the young generation's count of net allocations: with
# many small jobs the count stayed near zero while 300,000 young objects piled up, and the young and
# middle collections that finally came paused the event loop 0.4-0.9 s (the many-jobs report p99
# was 450-900 ms at 10,000 nodes). So the ticker collects the young and middle generations together
# every tick (``service.TICK_SECONDS``), whatever the count says: each object is visited once, not twice,
# and a pause is what arrived in a quarter second (under 30 ms at 10,000 nodes). The thresholds stay
# for what comes between ticks; a full collection (the cluster's state: message structs are
# untracked, ``messages.py``) waits for 14,400 middle ones, an hour of ticks, and Python's own rule
# that a quarter of the old objects are new (1.6 s at 10,000 nodes, measured at shutdown).
GC_THRESHOLDS = (10_000, 5, 14_400)


# Each node keeps one or two connections open to the coordinator (its reports and a restore's long poll),
# each an open file; the rest is the coordinator's own (listening socket, API watches, logs).
CONNECTIONS_PER_NODE = 2
OTHER_OPEN_FILES = 1_000


def raise_open_file_limit() -> int:
    """Raises this process's soft limit on open files to its hard limit, as Go programs do at start.

    Container runtimes commonly give a soft limit of 1,024 under a hard one of 524,288 or more; at
    ``CONNECTIONS_PER_NODE`` files a node, 1,024 runs out before 500 nodes.

    Returns:
      The soft limit in force afterwards (``resource.RLIM_INFINITY`` when unlimited).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as err:  # a platform that refuses the hard limit keeps the soft one
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, err)
    return soft


def prepare_for_connections() -> None:
    """Raises the open-file limit (logged with about how many nodes it holds) and makes every TLS
    connection read into one shared buffer (``share_tls_read_buffer``). Called before the app is built."""
    files = raise_open_file_limit()
    if files != resource.RLIM_INFINITY:
        nodes = max(0, files - OTHER_OPEN_FILES) // CONNECTIONS_PER_NODE
        log.info("open-file limit %d: enough for about %d nodes", files, nodes)
    share_tls_read_buffer()


def tune_collector() -> None:
    """Sets ``GC_THRESHOLDS`` and moves everything alive now out of the collector's sight: the modules and
    the app live as long as the process, so no collection need walk them. Called once the app is built."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
