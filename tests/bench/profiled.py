"""Runs a module under cProfile in every thread: ``python -m tests.bench.profiled OUT -m MODULE [ARGS...]``.

``python -m cProfile`` sees the main thread only, and the node agent does its file work in
``asyncio.to_thread`` workers and its CSI calls on gRPC threads. Here each thread starts its own
profiler on its first event (``threading.setprofile``); when the module returns (the agent exits
on SIGTERM) the profiles are merged and written to OUT in ``pstats`` format. Times are each
thread's CPU seconds (``time.thread_time``), not wall time: a thread blocked in ``epoll`` or on a
queue costs nothing. SIGUSR1 discards what was profiled so far, so a caller can profile a steady
state without the start-up (imports, first requests).
"""

import cProfile
import pstats
import runpy
import signal
import sys
import threading
import time

_profiles: list[cProfile.Profile] = []
_lock = threading.Lock()


def _start_in_this_thread(*_) -> None:
    profile = cProfile.Profile(time.thread_time)
    with _lock:
        _profiles.append(profile)
    profile.enable()  # replaces this hook for the thread


def _clear(*_) -> None:
    with _lock:
        for profile in _profiles:
            profile.clear()


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[2] != "-m":
        sys.exit("usage: python -m tests.bench.profiled OUT -m MODULE [ARGS...]")
    out, module = sys.argv[1], sys.argv[3]
    sys.argv = [module, *sys.argv[4:]]
    threading.setprofile(_start_in_this_thread)
    signal.signal(signal.SIGUSR1, _clear)
    main_profile = cProfile.Profile(time.thread_time)
    _profiles.append(main_profile)
    try:
        main_profile.enable()
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit:
        pass
    finally:
        main_profile.disable()
        threading.setprofile(None)
        merged = None
        with _lock:
            for profile in _profiles:
                profile.create_stats()
                if profile.stats:  # pstats refuses an empty profile (a thread that never ran Python code)
                    merged = pstats.Stats(profile) if merged is None else merged.add(profile)
        if merged is not None:
            merged.dump_stats(out)


if __name__ == "__main__":
    main()
