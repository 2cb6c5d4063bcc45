"""One turn of the engine core, the same on a thread or in a process of its own.

    core = CoreLoop(llm_engine)
    while True:
        commands = wait_for_commands(timeout=core.wait_timeout)   # None: block until one comes
        report = core.turn(commands)                              # apply them in order, then one step
        send(report)
        if report.stopped: break

A request arrives admitted (`AddRequest`); one whose grammar the core has not compiled yet waits, parked,
while its grammar compiles on the grammar worker, so a slow schema never holds up a step. An abort reaches
a request wherever it is: parked, waiting or running. Pure logic over the engine, no I/O.
"""

from __future__ import annotations

import time

from engine.core.arena import Arena
from engine.core.messages import (
    Abort,
    AddRequest,
    Command,
    DropAdapter,
    ExportBlocks,
    ImportBlocks,
    Stop,
    TransferDone,
    TurnReport,
    portable,
)
from engine.outputs import CompletionDelta, RequestDelta, RequestMetrics

PARKED_POLL_S = 0.005  # how often a core with only parked requests looks at their grammars


class CoreLoop:
    def __init__(self, engine, arena: Arena):
        """engine: an engine.llm_engine.LLMEngine (not imported here: that module loads torch); arena: the memory
        shared with the front end, where transfer payloads are written and read (engine/core/arena.py)."""
        self.engine = engine
        self.arena = arena
        self._parked: dict[str, AddRequest] = {}  # waiting for their grammar, in arrival order

    @property
    def wait_timeout(self) -> float | None:
        """How long to wait for commands: 0 while there is a step to run, None (forever) when idle."""
        if self.engine.has_unfinished_requests():
            return 0.0
        return PARKED_POLL_S if self._parked else None

    def turn(self, commands: list[Command]) -> TurnReport:
        engine = self.engine
        outputs: list[RequestDelta] = []
        errors: list[tuple[str, BaseException]] = []
        moves: list[ExportBlocks | ImportBlocks] = []
        stopping = False
        for cmd in commands:
            if isinstance(cmd, AddRequest):
                self._parked[cmd.request_id] = cmd
            elif isinstance(cmd, Abort) and cmd.index is not None:
                engine.stop_completion(cmd.request_id, cmd.index)
            elif isinstance(cmd, Abort):
                parked = self._parked.pop(cmd.request_id, None)
                out = _aborted(parked) if parked is not None else engine.abort_request(cmd.request_id)
                if out is not None:
                    outputs.append(out)
            elif isinstance(cmd, DropAdapter):
                engine.remove_lora(cmd.adapter_id)
            elif isinstance(cmd, (ExportBlocks, ImportBlocks)):
                moves.append(cmd)
            elif isinstance(cmd, Stop):
                stopping = True
        self._admit_parked(errors)
        # after the new requests: an export sees their prompts
        transfers = [_transfer(engine, cmd, self.arena) for cmd in moves]
        if stopping:
            outputs.extend(_aborted(p) for p in self._parked.values())
            self._parked.clear()
            outputs.extend(engine.abort_all())
        elif engine.has_unfinished_requests():
            outputs.extend(engine.step())
        return TurnReport(outputs, errors, engine.drain_kv_events(), engine.stats(), stopped=stopping,
                          transfers=transfers)

    def _admit_parked(self, errors: list[tuple[str, BaseException]]) -> None:
        engine = self.engine
        for rid, add in list(self._parked.items()):
            guide = add.params.guide
            if guide is not None and not engine.grammars.ready(guide):
                continue
            del self._parked[rid]
            try:
                engine.add_sequence(engine.make_sequence(add.request_id, add.prompt_token_ids, add.params,
                                                         add.cache_salt, add.arrival_time))
            except Exception as e:  # noqa: BLE001 - reported to that request's stream
                errors.append((rid, e))


def _transfer(engine, cmd: ExportBlocks | ImportBlocks, arena: Arena) -> TransferDone:
    started = time.monotonic()
    try:
        with arena.view(*cmd.region) as buf:
            if isinstance(cmd, ExportBlocks):
                hashes, tokens, lora, size, pending = engine.export_blocks(cmd.hashes, cmd.max_blocks, buf)
                return TransferDone(cmd.transfer_id, tuple(hashes), tuple(tokens), lora, size, pending=pending,
                                    started_at=started)
            imported, present = engine.import_blocks(cmd.prefix, cmd.hashes, cmd.tokens, cmd.lora, buf)
            return TransferDone(cmd.transfer_id, imported=imported, present=present, started_at=started)
    except Exception as e:  # noqa: BLE001 - one transfer's failure (a bad payload) is that transfer's, not the core's
        return TransferDone(cmd.transfer_id, error=portable(e), started_at=started)


def _aborted(add: AddRequest) -> RequestDelta:
    """The last delta of a request aborted before the engine saw it."""
    return RequestDelta(add.request_id, [CompletionDelta(0, finish_reason="abort")], True,
                        len(add.prompt_token_ids), 0, RequestMetrics(arrival_time=add.arrival_time))
