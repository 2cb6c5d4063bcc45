"""The engine core in a process of its own (the server's default), as vLLM v1 runs it.

    core = ProcessCore(args)          # spawns the process (the model loads there meanwhile)
    core.wait_ready()                 # blocks until the model is loaded; raises what the core raised if not
    core.start(report)                # a reader thread hands every TurnReport / CoreFailed to `report`
    core.send(AddRequest(...))        # commands go down one pipe, reports come up another
    core.send(Stop()); core.join()

Why: the loop that schedules, runs the model and samples holds Python's interpreter lock for its host
work, and so does the HTTP server; in one process each waits for the other. Apart, they overlap: the
front end tokenizes, formats SSE and writes sockets while the core runs the next step. The pipes are
local (multiprocessing's socket pairs); the process is spawned, never forked, so it inherits no threads.
A core that dies (killed, crashed) is seen as an end-of-file on the report pipe: the front end fails
every request with an error and reports itself not ready, as it did when the core was a thread.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
from collections.abc import Callable

from engine.core.arena import ARENA_BYTES, Arena
from engine.core.messages import Command, CoreFailed, CoreInfo, TurnReport
from engine.errors import EngineDeadError

logger = logging.getLogger(__name__)

START_POLL_S = 1.0


class ProcessCore:
    def __init__(self, args):
        """args: engine.args.EngineArgs. Returns at once; the caller does its own loading (the tokenizer)
        while the core loads the model, then calls wait_ready()."""
        from engine.core.worker import main

        ctx = mp.get_context("spawn")
        self.arena = Arena(ARENA_BYTES)  # transfer payloads cross here, not down the pipes (engine/core/arena.py)
        self._commands, child_commands = ctx.Pipe(duplex=False)[::-1]  # (send end here, receive end there)
        child_reports_recv, child_reports = ctx.Pipe(duplex=False)
        self._reports = child_reports_recv
        self._process = ctx.Process(target=main, name="kvfleet-engine-core", daemon=True,
                                    args=(args, child_commands, child_reports, self.arena, logging.getLogger().level))
        self._process.start()
        child_commands.close()
        child_reports.close()
        self._send_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self.info: CoreInfo | None = None

    def wait_ready(self) -> CoreInfo:
        """The core's CoreInfo once its model is loaded; raises what the core raised while loading."""
        if self.info is None:
            self.info = self._wait_ready()
        return self.info

    def _wait_ready(self) -> CoreInfo:
        while not self._reports.poll(START_POLL_S):
            if not self._process.is_alive():
                raise EngineDeadError(f"the engine core process exited with code {self._process.exitcode} "
                                      f"while loading the model")
        try:
            first = self._reports.recv()
        except EOFError:
            self._process.join(5)
            raise EngineDeadError(f"the engine core process exited with code {self._process.exitcode} "
                                  f"while loading the model") from None
        if isinstance(first, CoreFailed):
            self._process.join(5)
            raise first.error
        return first

    def start(self, report: Callable[[TurnReport | CoreFailed], None]) -> None:
        self._reader = threading.Thread(target=self._read, args=(report,), name="kvfleet-core-reader", daemon=True)
        self._reader.start()

    def send(self, command: Command) -> None:
        with self._send_lock:
            try:
                self._commands.send(command)
            except OSError:  # the core is gone; the reader thread reports it
                pass

    def kill(self) -> None:
        """Stop a core whose front end gave up before it was ready (e.g. the tokenizer failed to load)."""
        self._process.kill()
        self._process.join(5)
        self._commands.close()

    def join(self, timeout: float | None = None) -> None:
        if self._reader is not None:
            self._reader.join(timeout)
        self._process.join(timeout)
        if self._process.is_alive():
            logger.warning("the engine core did not stop in %s s; killing it", timeout)
            self._process.kill()
            self._process.join(5)
        self._commands.close()

    def _read(self, report: Callable[[TurnReport | CoreFailed], None]) -> None:
        while True:
            try:
                item = self._reports.recv()
            except (EOFError, OSError):
                self._process.join(5)
                report(CoreFailed(EngineDeadError(f"the engine core process died (exit code "
                                                  f"{self._process.exitcode})"), during_start=False))
                return
            report(item)
            if isinstance(item, CoreFailed) or (isinstance(item, TurnReport) and item.stopped):
                return
