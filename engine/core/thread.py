"""The engine core on a thread of the front end's process (tests, Ray replicas, `--engine-core thread`).

Same loop as the core process (engine/core/loop.py); commands go through a condition variable instead of
a pipe, and reports are handed to `report` on the core thread, as the process core's reader thread does.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from engine.core.arena import ARENA_BYTES, Arena
from engine.core.loop import CoreLoop
from engine.core.messages import Command, CoreFailed, CoreInfo, TurnReport

logger = logging.getLogger(__name__)


class ThreadCore:
    def __init__(self, engine):
        """engine: an engine.llm_engine.LLMEngine, loaded."""
        self.engine = engine
        kv = engine.kv
        self.info = CoreInfo(engine.model_name, engine.limits, engine.hash_seed, engine.config.vocab_size,
                             list(kv.snapshot()), kv.last_event_seq, engine.kv_layout, 0, engine.stats())
        kv.drain_events()  # covered by the snapshot
        self.tokenizer = engine.tokenizer
        self.grammars = engine.grammars
        self.arena = Arena(ARENA_BYTES)  # transfer payloads (engine/core/arena.py), as with a core process
        self._cv = threading.Condition()
        self._commands: list[Command] = []
        self._thread: threading.Thread | None = None

    def start(self, report: Callable[[TurnReport | CoreFailed], None]) -> None:
        self._thread = threading.Thread(target=self._run, args=(report,), name="kvfleet-engine", daemon=True)
        self._thread.start()

    def send(self, command: Command) -> None:
        with self._cv:
            self._commands.append(command)
            self._cv.notify()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self, report: Callable[[TurnReport | CoreFailed], None]) -> None:
        core = CoreLoop(self.engine, self.arena)
        try:
            while True:
                with self._cv:
                    timeout = core.wait_timeout
                    if not self._commands and timeout != 0.0:
                        self._cv.wait(timeout)
                    commands, self._commands = self._commands, []
                rep = core.turn(commands)
                report(rep)
                if rep.stopped:
                    return
        except BaseException as e:  # the loop died: the front end fails every request instead of hanging them
            logger.exception("engine loop failed")
            report(CoreFailed(e, during_start=False))
