"""The engine core process's main: load the model, then turn the loop until told to stop.

Started by engine/core/process.py with the `spawn` method, so nothing of the front end's state (its
event loop, sockets, threads) is inherited. It ignores SIGINT and SIGTERM (the front end drains and then
sends `Stop`), dies with its parent (PR_SET_PDEATHSIG on Linux, and an end-of-file on the command pipe
anywhere), and reports a failure to load or a dead loop as `CoreFailed` before it exits.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from multiprocessing.connection import Connection

from engine.core.arena import Arena
from engine.core.loop import CoreLoop
from engine.core.messages import CoreFailed, CoreInfo, portable

logger = logging.getLogger("kvfleet.core")


def main(args, commands: Connection, reports: Connection, arena: Arena, log_level: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s")
    try:
        from engine.llm_engine import LLMEngine

        engine = LLMEngine(args)
    except BaseException as e:  # noqa: BLE001 - reported to the front end, which decides how to exit
        logger.exception("the engine core failed to start")
        reports.send(CoreFailed(portable(e), during_start=True))
        sys.exit(1)
    kv = engine.kv
    reports.send(CoreInfo(engine.model_name, engine.limits, engine.hash_seed, engine.config.vocab_size,
                          list(kv.snapshot()), kv.last_event_seq, engine.kv_layout, os.getpid(), engine.stats()))
    kv.drain_events()  # covered by the snapshot
    code = _serve(CoreLoop(engine, arena), commands, reports)
    # the last report (stopped, or the failure) is sent: skip the interpreter's teardown of torch (most of a
    # second, which a rolling restart would wait for)
    logging.shutdown()
    os._exit(code)


def _serve(core: CoreLoop, commands: Connection, reports: Connection) -> int:
    try:
        while True:
            batch = []
            if commands.poll(core.wait_timeout):
                batch.append(commands.recv())
                while commands.poll(0):
                    batch.append(commands.recv())
            report = core.turn(batch)
            reports.send(report)
            if report.stopped:
                return 0
    except (EOFError, BrokenPipeError):  # the front end is gone: nobody to serve
        return 0
    except BaseException as e:  # noqa: BLE001 - the loop died: tell the front end, which fails every request
        logger.exception("engine loop failed")
        try:
            reports.send(CoreFailed(portable(e), during_start=False))
        except OSError:
            pass
        return 1


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
