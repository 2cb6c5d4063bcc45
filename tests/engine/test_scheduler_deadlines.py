"""TTFT deadlines in the waiting queue (engine/scheduler.py `Scheduler.due`), exactly: earliest due first, a request
without a target (or past it) best effort at arrival + priority_aging_s, arrival order when nobody has a target,
fair share across ids and priority still on top, and the same tokens whatever the order."""

from __future__ import annotations

from engine.sequence import SequenceStatus
from tests.engine.test_scheduler_harness import FakeEngine


def started(eng: FakeEngine) -> list[str]:
    """Run one-seat steps until the queue is empty: the order in which the requests got their first token."""
    order: list[str] = []
    for _ in range(200):
        if not eng.sched.waiting and not eng.sched.running:
            break
        out = eng.step()
        order += [i.seq.request_id for i in out.scheduled if i.seq.request_id not in order]
    return order


def test_a_request_with_a_ttft_target_goes_before_batch_prompts_that_came_first():
    eng = FakeEngine(budget=64, max_num_seqs=1)
    eng.add("batch-1", [1] * 16, max_tokens=1)  # at 0
    eng.now = 0.1
    eng.add("batch-2", [2] * 16, max_tokens=1)
    eng.now = 0.2
    eng.add("chat", [3] * 4, max_tokens=1, ttft_target_s=1.5)  # due 1.7, the batches 30 and 30.1
    assert [eng.sched.due(s, eng.now) for s in eng.sched.waiting] == [30.0, 30.1, 1.7]
    assert started(eng) == ["chat", "batch-1", "batch-2"]


def test_targets_go_earliest_due_first_not_tightest_first():
    eng = FakeEngine(budget=64, max_num_seqs=1)
    eng.add("loose-early", [1] * 4, max_tokens=1, ttft_target_s=2.0)  # due 2.0
    eng.now = 1.0
    eng.add("tight-late", [2] * 4, max_tokens=1, ttft_target_s=0.5)  # due 1.5
    eng.add("looser-late", [3] * 4, max_tokens=1, ttft_target_s=1.5)  # due 2.5
    assert started(eng) == ["tight-late", "loose-early", "looser-late"]


def test_a_missed_target_is_best_effort_and_does_not_delay_one_still_attainable():
    eng = FakeEngine(budget=64, max_num_seqs=1)
    eng.add("batch", [1] * 4, max_tokens=1)  # due 30
    eng.now = 0.1
    eng.add("missed", [2] * 4, max_tokens=1, ttft_target_s=0.5)  # due 0.6, past at 1.0: then 30.1
    eng.now = 0.9
    eng.add("fresh", [3] * 4, max_tokens=1, ttft_target_s=1.0)  # due 1.9
    eng.now = 1.0
    assert [eng.sched.due(s, eng.now) for s in eng.sched.waiting] == [30.0, 30.1, 1.9]
    assert started(eng) == ["fresh", "batch", "missed"]


def test_a_request_without_a_target_waits_for_targets_at_most_the_aging_period():
    eng = FakeEngine(budget=64, max_num_seqs=1, aging_s=10.0)
    eng.add("running", [9] * 4, max_tokens=50)  # holds the seat
    eng.step()
    eng.add("batch", [1] * 4, max_tokens=1)  # at 0: due 10
    eng.now = 8.4
    eng.add("chat-in-time", [2] * 4, max_tokens=1, ttft_target_s=1.5)  # due 9.9: still before the batch
    eng.now = 8.6
    eng.add("chat-too-late", [3] * 4, max_tokens=1, ttft_target_s=1.5)  # due 10.1: after it
    assert started(eng)[1:] == ["chat-in-time", "batch", "chat-too-late"]


def test_without_targets_the_queue_is_arrival_order_untouched():
    eng = FakeEngine(budget=64, max_num_seqs=1)
    for k in range(4):
        eng.now = 0.1 * (3 - k)  # arrival times going backwards: the queue order is what counts, as before
        eng.add(f"r{k}", [k + 1] * 4, max_tokens=1)
    assert started(eng) == ["r0", "r1", "r2", "r3"]


def test_a_preempted_sequence_stays_ahead_of_a_due_target():
    eng = FakeEngine(num_blocks=6, block_size=4, budget=64, max_num_seqs=4)
    eng.add("old", [1] * 8, max_tokens=12)
    eng.add("new", [2] * 8, max_tokens=12)
    preempted = None
    for _ in range(20):
        out = eng.step()
        if out.preempted:
            preempted = out.preempted[0].request_id
            break
    assert preempted == "new"
    eng.add("chat", [3] * 4, max_tokens=1, ttft_target_s=0.5)
    eng.sched._order_waiting()
    assert [s.request_id for s in eng.sched.waiting] == ["new", "chat"]


def test_fair_share_across_tenants_comes_first_then_deadlines_within_each():
    eng = FakeEngine(budget=64, max_num_seqs=1)
    eng.add("a-batch", [1] * 8, max_tokens=1, fairness_id="a")
    eng.add("a-chat", [2] * 4, max_tokens=1, fairness_id="a", ttft_target_s=1.0)
    eng.add("b-batch", [3] * 8, max_tokens=1, fairness_id="b")
    eng.add("b-chat", [4] * 4, max_tokens=1, fairness_id="b", ttft_target_s=1.0)
    # each tenant's chat first (due 1.0 against 30), the tenants alternating by their counters (a's 4 prompt tokens
    # charged: b's 0 goes next)
    assert started(eng) == ["a-chat", "b-chat", "b-batch", "a-batch"]


def test_under_priority_the_due_time_orders_equal_priorities_only():
    eng = FakeEngine(budget=64, max_num_seqs=1, policy="priority")
    eng.add("urgent-batch", [1] * 4, max_tokens=1, priority=-1)
    eng.add("batch", [2] * 4, max_tokens=1)
    eng.add("chat", [3] * 4, max_tokens=1, ttft_target_s=1.0)
    assert started(eng) == ["urgent-batch", "chat", "batch"]


def test_the_order_changes_no_token():
    def run(targets: bool) -> dict[str, list[int]]:
        eng = FakeEngine(budget=16, max_num_seqs=3)
        for k in range(6):
            eng.now = 0.05 * k
            eng.add(f"r{k}", [k + 1] * (4 + 3 * k), max_tokens=5,
                    ttft_target_s=(0.2 if k % 2 else None) if targets else None)
        started(eng)
        assert all(s.status is SequenceStatus.FINISHED_LENGTH for s in eng.seqs)
        assert eng.kv.num_free_blocks == 64
        return {s.request_id: s.output_token_ids for s in eng.seqs}

    assert run(True) == run(False)


def steps(eng: FakeEngine, n: int = 1) -> list[dict[str, int]]:
    return [{i.seq.request_id: i.num_new_tokens for i in eng.step().scheduled} for _ in range(n)]


def test_a_running_batch_prompt_leaves_the_steps_to_a_prompt_due_before_it_until_that_has_its_token():
    eng = FakeEngine(budget=16, max_num_seqs=4)
    eng.add("batch", [1] * 60, max_tokens=2)  # due 30
    assert steps(eng) == [{"batch": 16}]
    eng.now = 0.1
    eng.add("chat", [2] * 40, max_tokens=2, ttft_target_s=1.5)  # due 1.6: bigger than a step
    # waiting, then running after the batch in the list: the batch's chunk leaves it the step until its prompt is done
    assert steps(eng, 4) == [{"chat": 16}, {"chat": 16}, {"batch": 8, "chat": 8}, {"batch": 15, "chat": 1}]


def test_a_running_prompt_yields_to_no_target_already_past_nor_to_one_due_after_it():
    eng = FakeEngine(budget=16, max_num_seqs=4, aging_s=10.0)
    eng.add("batch", [1] * 60, max_tokens=2)  # due 10
    assert steps(eng) == [{"batch": 16}]
    eng.now = 9.0
    eng.add("late-chat", [2] * 40, max_tokens=2, ttft_target_s=1.5)  # due 10.5: after the batch
    assert steps(eng) == [{"batch": 16}]
    eng2 = FakeEngine(budget=16, max_num_seqs=4)
    eng2.add("batch", [1] * 60, max_tokens=2)
    eng2.step()
    eng2.add("chat", [2] * 40, max_tokens=2, ttft_target_s=0.5)
    assert steps(eng2) == [{"chat": 16}]
    eng2.now = 0.6  # the chat's target has passed: best effort (due 30), after the batch (due 30, earlier in queue)
    assert steps(eng2) == [{"batch": 16}]


def test_under_priority_a_running_prompt_yields_only_to_no_worse_a_priority():
    eng = FakeEngine(budget=16, max_num_seqs=4, policy="priority")
    eng.add("batch", [1] * 60, max_tokens=2, priority=-1)
    eng.step()
    eng.add("chat", [2] * 40, max_tokens=2, ttft_target_s=1.5)  # due earlier, but of a worse priority
    assert steps(eng) == [{"batch": 16}]
    eng2 = FakeEngine(budget=16, max_num_seqs=4, policy="priority")
    eng2.add("batch", [1] * 60, max_tokens=2)
    eng2.step()
    eng2.add("chat", [2] * 40, max_tokens=2, ttft_target_s=1.5)  # the same priority: due first
    assert steps(eng2) == [{"chat": 16}]
