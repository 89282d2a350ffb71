"""The scheduler's rules, with no model and no torch: items stand in with prepared inputs of a given length (a
list's shape), the decoder is a few callables over the real BlockPool. Each rule is broken once in a test below's
comment to show what it guards."""

from __future__ import annotations

import time
import types
from concurrent.futures import Future

import pytest

from runpod_vlm.engine import scheduler as scheduler_module
from runpod_vlm.engine.blocks import BlockPool
from runpod_vlm.engine.scheduler import Scheduler
from runpod_vlm.engine.ticket import Ticket
from runpod_vlm.vocabulary import GenerationParams, GenerationRequest, RequestError, Turn

BLOCK = 16


class Inputs(dict):
    """Prepared inputs whose input_ids have a shape, as a processor's tensors do."""

    def __init__(self, length: int):
        super().__init__(input_ids=types.SimpleNamespace(shape=(1, length)))


def ticket(length: int, max_new: int = 8, call=None, ready: bool = True, error: Exception | None = None) -> Ticket:
    item = GenerationRequest("chat", [Turn("user", ["x"])], GenerationParams(max_new, 0.0, 1.0, False))
    told = []
    made = Ticket(item, told.append, stream=False)
    made.told = told
    made.call = call if call is not None else object()
    made.prepared = Future()
    if error is not None:
        made.prepared.set_exception(error)
    elif ready:
        made.prepared.set_result((Inputs(length), None, {}))
    return made


def planner(budget: int = 256, blocks: int = 64, context: int | None = None) -> Scheduler:
    scheduler = Scheduler(budget, media_token_ids={99}, context_length=context)
    scheduler.pool = BlockPool(blocks + 1, BLOCK)
    return scheduler


def lengths_of(group: list[Ticket]) -> list[int]:
    return [t.prepared.result()[0]["input_ids"].shape[1] for t in group]


def test_a_prefill_stays_within_the_token_budget_packed_or_padded():
    scheduler = planner(budget=256)
    queue = [ticket(100), ticket(100), ticket(50), ticket(10)]
    scheduler.add(queue)
    group, _ = scheduler.next_group(list(scheduler.waiting), free=list(range(8)), packs=True)
    assert lengths_of(group) == [100, 100, 50]  # 250 packed; the 10 would make 260
    scheduler = planner(budget=256)
    scheduler.add([ticket(100), ticket(100), ticket(50)])
    group, _ = scheduler.next_group(list(scheduler.waiting), free=list(range(8)), packs=False)
    assert lengths_of(group) == [100, 100]  # padded to the longest: a third makes 300


def test_items_go_in_arrival_order_and_a_long_one_is_never_passed_over():
    scheduler = planner(budget=256)
    queue = [ticket(200), ticket(200), ticket(10)]
    scheduler.add(queue)
    group, _ = scheduler.next_group(list(scheduler.waiting), free=list(range(8)), packs=True)
    assert group == queue[:1]  # the short one behind does not jump the second long one
    long = ticket(1000)  # longer than a whole prefill: alone (then in chunks)
    scheduler.add([long])
    scheduler.take(queue[1:])
    group, _ = scheduler.next_group([long], free=list(range(8)), packs=True)
    assert group == [long]


def test_while_a_prompt_enters_in_chunks_no_other_long_one_starts_and_its_row_is_not_free():
    scheduler = planner(budget=256)
    chunking = ticket(1000)
    scheduler.chunking = (chunking, types.SimpleNamespace(row=0))
    assert scheduler.free_rows([0, 1, 2]) == [1, 2]
    queue = [ticket(300), ticket(10)]
    scheduler.add(queue)
    group, _ = scheduler.next_group(list(scheduler.waiting), free=[1, 2], packs=True)
    assert group == []  # waits its turn, and holds the short one behind it


def test_free_rows_and_group_limits_bound_a_group():
    scheduler = planner()
    queue = [ticket(10) for _ in range(5)]
    scheduler.add(queue)
    group, _ = scheduler.next_group(list(scheduler.waiting), free=[3, 4], packs=True)
    assert group == queue[:2]
    scheduler.requeue(group, limit=1)  # a group that failed comes back one at a time
    group, _ = scheduler.next_group(list(scheduler.waiting), free=[3, 4], packs=True)
    assert group == queue[:1]


def test_a_call_still_being_prepared_holds_up_no_other_call():
    scheduler = planner()
    batch_call = object()
    slow = [ticket(10, call=batch_call), ticket(10, call=batch_call, ready=False)]
    other = ticket(10)
    scheduler.add([*slow, other])
    group, _ = scheduler.next_group(list(scheduler.waiting), free=list(range(8)), packs=True)
    assert group == [other]  # the batch call's ready item waits for its mate; the other call goes
    slow[1].prepared.set_result((Inputs(10), None, {}))
    group, _ = scheduler.next_group(list(scheduler.waiting), free=list(range(8)), packs=True)
    assert group == slow


def test_an_item_whose_preparation_failed_is_answered_and_leaves_the_queue():
    scheduler = planner()
    refused = ticket(10, error=RequestError("invalid_image", "no", "image_url"))
    broken = ticket(10, error=ValueError("processor bug"))
    fine = ticket(10)
    scheduler.add([refused, broken, fine])
    group, _ = scheduler.next_group(list(scheduler.waiting), free=list(range(8)), packs=True)
    assert group == [fine] and not scheduler.waiting
    assert refused.told[-1].code == "invalid_image" and broken.told[-1].code == "generation_failed"


def test_cancelled_items_leave_the_queue_at_the_next_step():
    scheduler = planner()
    queue = [ticket(10), ticket(10)]
    scheduler.add(queue)
    queue[0].cancel()
    assert scheduler.drop_cancelled() == queue[1:]


def test_when_blocks_run_short_the_newest_row_is_preempted_and_resumes_alone_first():
    scheduler = planner(blocks=6)  # 96 tokens
    pool, released = scheduler.pool, []
    old, new = ticket(40, max_new=100), ticket(40, max_new=100)
    for row, t in enumerate((old, new)):
        pool.grow(row, 40)
        scheduler.give_row(t, row)
    new.ids = [1, 2, 3]
    lengths = {0: 40, 1: 40}

    def release(row):
        released.append(row)
        pool.release(row)

    scheduler.make_room(steps=16, ahead={}, lengths=lengths, grow=pool.grow, release=release)
    assert released == [1] and list(scheduler.running) == [0]  # the newest went, the oldest grew
    assert scheduler.waiting == [new] and new.row is None
    behind = ticket(10)
    scheduler.add([behind])
    group, _ = scheduler.next_group(list(scheduler.waiting), free=[1, 2, 3], packs=True)
    assert group == [new]  # first in line, and alone: it resumes with the tokens it had
    # Broken once: preempting the oldest (min instead of max of `admitted`) fails the first assertion.


def test_a_decode_step_out_of_memory_caps_the_rows_until_idle_or_a_while():
    scheduler = planner()
    released = []
    for row in range(12):
        scheduler.give_row(ticket(10), row)
    scheduler.step_out_of_memory(buckets=[8, 16], bucket=16, release=released.append)
    assert sorted(released) == list(range(8, 12)) and len(scheduler.waiting) == 4
    assert scheduler.free_rows(list(range(8, 16))) == []  # capped at 8 while rows run
    scheduler.row_cap = 8, time.monotonic() - scheduler_module.ROW_CAP_S - 1
    assert scheduler.free_rows(list(range(8, 16))) == list(range(8, 16))  # lifted after a while
    scheduler.running.clear()
    scheduler.row_cap = 8, time.monotonic()
    assert scheduler.free_rows([8]) == [8]  # and when idle


def test_at_the_smallest_bucket_an_out_of_memory_step_fails_its_rows():
    scheduler = planner()
    running = [ticket(10) for _ in range(3)]
    for row, t in enumerate(running):
        scheduler.give_row(t, row)
    scheduler.step_out_of_memory(buckets=[8], bucket=8, release=lambda row: None)
    assert [t.told[-1].code for t in running] == ["out_of_memory"] * 3 and not scheduler.running


def test_a_placement_out_of_memory_retries_in_halves_down_to_one_then_fails_it():
    scheduler = planner()
    group = [ticket(10) for _ in range(4)]
    scheduler.out_of_memory(group)
    assert scheduler.waiting == group and {t.group_limit for t in group} == {2}
    scheduler.take(group)
    scheduler.out_of_memory(group[:2])
    assert {t.group_limit for t in group[:2]} == {1}
    scheduler.take(group)
    scheduler.out_of_memory(group[:1], prompt_tokens=10)
    assert group[0].told[-1].code == "out_of_memory" and not scheduler.waiting


def test_requests_past_the_context_or_the_whole_pool_are_refused():
    scheduler = planner(blocks=10, context=200)  # 160 tokens of KV
    assert scheduler.refusal(ticket(150, max_new=100).item, 150).code == "context_too_long"
    assert scheduler.refusal(ticket(100, max_new=70).item, 100).code == "out_of_memory"
    assert scheduler.refusal(ticket(100, max_new=60).item, 100) is None
    assert scheduler.rows_that_fit([64, 64, 64], [8, 8, 8], interval=8) == 2  # 5 + 5 of 10 blocks; a third: 15


def test_fail_all_releases_every_row_and_tells_every_item():
    scheduler = planner()
    running, queued, chunking = ticket(10), ticket(10), ticket(10)
    scheduler.give_row(running, 0)
    scheduler.add([queued])
    scheduler.chunking = (chunking, types.SimpleNamespace(row=1))
    released = []
    scheduler.fail_all(RequestError("worker_stopping", "bye"), queued=True, release=released.append)
    assert sorted(released) == [0, 1] and not scheduler.busy() and not scheduler.waiting
    assert [t.told[-1].code for t in (running, queued, chunking)] == ["worker_stopping"] * 3


@pytest.mark.parametrize("keep_queue", [True, False])
def test_fail_all_keeps_the_queue_when_asked(keep_queue):
    scheduler = planner()
    queued = ticket(10)
    scheduler.add([queued])
    scheduler.fail_all(RequestError("generation_failed", "x"), queued=not keep_queue, release=lambda row: None)
    assert (scheduler.waiting == [queued]) == keep_queue


def test_prompts_of_one_prefill_that_start_alike_read_the_earliest_ones_blocks_or_the_longer_cached_run():
    scheduler = planner()
    system = list(range(1000, 1064))  # four full blocks shared by the burst
    prompts = [system + [1, 2, 3], system[:40] + [7] * 30, system + [5] * 20, [8] * 40, system]
    group = [ticket(len(ids)) for ids in prompts]
    for made, ids in zip(group, prompts):
        made.prefix = scheduler.prefix_of(made.item, ids)
    cached = BLOCK * 2  # an earlier prompt left its first two blocks cached
    scheduler.pool.grow("done", cached)
    scheduler.pool.remember("done", group[3].prefix[:2])
    scheduler.pool.release("done")
    shared = scheduler.shared_prefixes(group, [len(ids) for ids in prompts])
    assert [(s.count, s.earlier) for s in shared] == [(0, None), (2, 0), (4, 0), (2, None), (3, 0)]
    # the first computes its blocks; the second shares the two whole blocks it has in common with it; the fourth
    # reads its cached run; the last, the system prompt alone, leaves the block of its last token to compute
    assert shared[3].cached == scheduler.pool.cached_prefix(group[3].prefix[:2])


def test_a_family_whose_prompts_prefill_alone_gets_one_a_prefill():
    scheduler = Scheduler(256, media_token_ids={99}, prefills_alone=True)
    scheduler.pool = BlockPool(65, BLOCK)
    scheduler.add([ticket(10), ticket(10)])
    group, _ = scheduler.next_group(list(scheduler.waiting), free=list(range(8)), packs=True)
    assert len(group) == 1 and len(scheduler.waiting) == 1


def test_a_row_reaching_longrope_s_original_context_is_prefilled_again_and_no_interval_passes_it():
    scheduler = Scheduler(256, media_token_ids={99}, recompute_at=64)
    scheduler.pool, released = BlockPool(65, BLOCK), []
    rows = [ticket(10, max_new=100) for _ in range(3)]
    for row, t in enumerate(rows):
        scheduler.pool.grow(row, 10)
        scheduler.give_row(t, row)
    lengths = {0: 60, 1: 64, 2: 70}  # before it, at it (its next token sits at position 64), past it
    assert scheduler.steps_before_recompute(8, lengths) == 4  # row 0 stops at 64
    assert scheduler.at_recompute(lengths) == [1]
    rows[1].ids = [5] * 54
    scheduler.recompute([1], lambda row: released.append(row) or scheduler.pool.release(row))
    assert released == [1] and scheduler.waiting == [rows[1]] and rows[1].ids == [5] * 54  # resumes with its tokens
    assert scheduler.steps_before_recompute(8, {0: 64, 2: 70}) == 8
    rows[0].ids = [5, 99, 5]  # it generated an image placeholder, which a prefill would take for an image's
    scheduler.recompute([0], lambda row: released.append(row))
    assert released == [1] and 0 in scheduler.running  # it goes on with its keys as they are
    assert Scheduler(256, media_token_ids={99}).steps_before_recompute(8, {}) == 8
    # Broken once each: `<=` for `==` in at_recompute (row 0 taken too), or no cap in steps_before_recompute.


def test_a_packed_prefill_counts_a_prompt_without_the_blocks_it_shares_with_the_ones_before_it():
    system = list(range(1000, 1080))  # five whole blocks
    prompts = [system + [n] * 20 for n in range(4)]  # 100 tokens each, 80 of them shared
    for packs, expected in ((True, 4), (False, 2)):
        scheduler = planner(budget=256)
        queue = [ticket(len(ids)) for ids in prompts]
        for made, ids in zip(queue, prompts):
            made.prefix = scheduler.prefix_of(made.item, ids)
        scheduler.add(queue)
        group, _ = scheduler.next_group(list(scheduler.waiting), free=list(range(8)), packs=packs)
        assert len(group) == expected  # packed: 100 + 3 x 20 tokens computed; padded: 100 each
