"""Scheduler and block manager on small builders: exact block ids, eviction, preemption and chunks."""

import itertools

import pytest

from chitu_core.engine.block_manager import BlockManager
from chitu_core.engine.scheduler import Scheduler
from chitu_core.engine.sequence import Request, Sequence, Status
from chitu_core.sampling.params import SamplingParams

_arrivals = itertools.count()


def make_request(prompt: list[int], max_tokens: int = 8, n: int = 1, priority: int = 0) -> Request:
    request = Request(f"r{next(_arrivals)}", None, prompt, SamplingParams(max_tokens=max_tokens, n=n), priority, next(_arrivals))
    request.seqs = [Sequence(100 * request.arrival + i, request, i, seed=0) for i in range(n)]
    return request


def run_step(sched: Scheduler, bm: BlockManager, sample: int = 7) -> list[tuple[str, int]]:
    """Schedule, pretend the model ran: advance computed tokens, cache blocks, append a token to
    sequences that reached their end. Returns (request id / sample, new tokens) per scheduled seq."""
    batch = sched.schedule()
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
        bm.cache_full_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.output_token_ids.append(sample)
    return [(f"{s.request.request_id}/{s.index}", n) for s, n in zip(batch.seqs, batch.num_new_tokens)]


def test_blocks_are_allocated_lowest_first_and_freed_tail_first():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a, b = make_request(list(range(10))).seqs[0], make_request(list(range(5))).seqs[0]
    bm.allocate(a, 10)
    bm.allocate(b, 5)
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4]
    bm.allocate(a, 13)
    assert a.block_table == [0, 1, 2, 5]
    bm.free(a)
    assert a.block_table == [] and bm.num_free == 6
    assert list(bm.free_queue) == [5, 2, 1, 0] and bm.ever_taken == 6  # 6 and 7, never taken, go first
    assert [blk.ref_count for blk in bm.blocks] == [0, 0, 0, 1, 1, 0, 0, 0]
    c = make_request(list(range(12))).seqs[0]
    bm.allocate(c, 12)
    assert c.block_table == [6, 7, 5]


def test_reuse_first_takes_released_blocks_before_unwritten_ones():
    # For a cache whose memory becomes resident as it is written: a's cached prefix is dropped rather
    # than a block never written being touched; the default keeps the prefix and writes new blocks.
    taken = {}
    for reuse_first in (True, False):
        bm = BlockManager(num_blocks=8, block_size=2, reuse_first=reuse_first)
        a = make_request([1, 2, 3, 4]).seqs[0]
        bm.allocate(a, 4)
        a.num_computed_tokens = 4
        bm.cache_full_blocks(a)
        bm.free(a)
        b = make_request([5, 6, 7]).seqs[0]
        bm.allocate(b, 3)
        c = make_request([8, 8]).seqs[0]
        bm.allocate(c, 2)
        taken[reuse_first] = (b.block_table, c.block_table, bm.ever_taken, sorted(bm.cached.values()), bm.num_free)
    assert taken[True] == ([1, 0], [2], 3, [], 5)
    assert taken[False] == ([2, 3], [4], 5, [0, 1], 5)


def test_prefix_cache_hit_shares_blocks_and_counts_references():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_request(list(range(10))).seqs[0]
    bm.allocate(a, 10)
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)  # blocks 0 and 1 are full; block 2 holds 2 tokens
    assert sorted(bm.cached.values()) == [0, 1]
    b = make_request(list(range(9)) + [99]).seqs[0]  # shares the first 9 tokens: two full blocks
    assert bm.match_prefix(b) == 8
    assert b.block_table == [0, 1] and b.num_computed_tokens == 8
    assert [bm.blocks[i].ref_count for i in (0, 1, 2)] == [2, 2, 1]
    bm.allocate(b, 10)
    assert b.block_table == [0, 1, 3]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in (0, 1, 2)] == [1, 1, 0]
    assert bm.prefix_queries == 10 and bm.prefix_hits == 8


def test_a_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_request(list(range(8))).seqs[0]
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    b = make_request(list(range(8))).seqs[0]
    assert bm.match_prefix(b) == 4  # the second block would leave nothing to compute
    assert b.block_table == [0] and b.num_new_tokens == 4


def test_eviction_takes_the_least_recently_released_block_and_forgets_its_prefix():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = make_request([1, 2, 3, 4]).seqs[0], make_request([5, 6, 7, 8]).seqs[0]
    for seq in (a, b):
        bm.allocate(seq, 4)
        seq.num_computed_tokens = 4
        bm.cache_full_blocks(seq)
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    bm.free(b)  # released first: 3 then 2
    bm.free(a)  # then 1 then 0
    assert list(bm.free_queue) == [3, 2, 1, 0]
    c = make_request([9, 9, 9]).seqs[0]
    bm.allocate(c, 3)
    assert c.block_table == [3, 2]
    assert set(bm.cached.values()) == {0, 1}  # b's prefix is gone, a's still cached
    d = make_request([1, 2, 3, 4, 5]).seqs[0]
    assert bm.match_prefix(d) == 4 and d.block_table == [0, 1]


def test_chunked_prefill_under_the_token_budget_with_decodes_first():
    bm = BlockManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=10)
    short, long_ = make_request([1, 2, 3]), make_request(list(range(100, 125)))
    for r in (short, long_):
        sched.add(r.seqs[0])
    s, l = short.request_id, long_.request_id
    assert run_step(sched, bm) == [(f"{s}/0", 3), (f"{l}/0", 7)]
    assert run_step(sched, bm) == [(f"{s}/0", 1), (f"{l}/0", 9)]
    assert run_step(sched, bm) == [(f"{s}/0", 1), (f"{l}/0", 9)]
    assert long_.seqs[0].num_computed_tokens == 25 and long_.seqs[0].output_token_ids == [7]
    assert run_step(sched, bm) == [(f"{s}/0", 1), (f"{l}/0", 1)]
    # short's fifth token (step 3) took block 5 before long grew past block 4.
    assert short.seqs[0].block_table == [0, 5] and long_.seqs[0].block_table == [1, 2, 3, 4, 6, 7, 8]


def test_fcfs_within_priority_and_max_num_seqs():
    bm = BlockManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=100)
    low1, high, low2 = make_request([1, 2], priority=1), make_request([3, 4], priority=0), make_request([5, 6], priority=1)
    for r in (low1, high, low2):
        sched.add(r.seqs[0])
    assert [x for x, _ in run_step(sched, bm)] == [f"{high.request_id}/0", f"{low1.request_id}/0"]
    assert [s.request.request_id for s in sched.waiting] == [low2.request_id]


def test_preemption_takes_the_newest_of_the_lowest_priority_and_recomputes_it():
    bm = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    old, mid, new = (make_request([i, i, i, i], max_tokens=8) for i in (1, 2, 3))
    urgent_late = make_request([9, 9], max_tokens=4, priority=-1)
    for r in (old, mid, new):
        sched.add(r.seqs[0])
    run_step(sched, bm)  # each holds 2 full blocks and has sampled a token: all 6 blocks used
    assert bm.num_free == 0
    sched.add(urgent_late.seqs[0])
    o, m, n = (f"{r.request_id}/0" for r in (old, mid, new))
    # old needs a third block: the newest running sequence (new) is preempted; mid takes the other.
    assert run_step(sched, bm) == [(o, 1), (m, 1)]
    assert [s.request.request_id for s in sched.waiting] == [urgent_late.request_id, new.request_id]
    assert new.seqs[0].status is Status.WAITING and new.seqs[0].num_computed_tokens == 0
    assert new.seqs[0].output_token_ids == [7]  # its sampled token is kept and recomputed, not lost
    assert run_step(sched, bm) == [(o, 1), (m, 1)]  # room in their third blocks; none free to admit
    # old needs a fourth block: mid is now the newest running one.
    assert run_step(sched, bm) == [(o, 1)]
    assert [s.request.request_id for s in sched.waiting] == [urgent_late.request_id, mid.request_id, new.request_id]
    assert sched.num_preemptions == 2 and mid.seqs[0].num_preemptions == 1 and new.seqs[0].num_preemptions == 1
    # Blocks come back tail first (new: 5, 4; later mid: 4, 3, 2) and are reused in that order.
    assert old.seqs[0].block_table == [0, 1, 5, 4] and mid.seqs[0].block_table == [] and bm.num_free == 2
    assert list(bm.free_queue) == [3, 2]


def test_a_sequence_that_is_itself_last_in_order_preempts_itself():
    bm = BlockManager(num_blocks=3, block_size=2, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    first, second = make_request([1, 1, 1, 1], max_tokens=2), make_request([2, 2], max_tokens=2, priority=5)
    sched.add(first.seqs[0])
    sched.add(second.seqs[0])
    run_step(sched, bm)
    assert bm.num_free == 0
    # first (priority 0) needs a block; second (priority 5) is the victim even though it comes later.
    assert run_step(sched, bm) == [(f"{first.request_id}/0", 1)]
    assert sched.waiting == [second.seqs[0]]


def test_samples_of_one_request_share_the_prompt_blocks():
    bm = BlockManager(num_blocks=32, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    r = make_request(list(range(10)), n=3)
    for seq in r.seqs:
        sched.add(seq)
    rid = r.request_id
    assert run_step(sched, bm) == [(f"{rid}/0", 10)]  # the siblings wait for the prompt
    assert run_step(sched, bm) == [(f"{rid}/0", 1), (f"{rid}/1", 2), (f"{rid}/2", 2)]
    s0, s1, s2 = r.seqs
    assert s1.block_table[:2] == s0.block_table[:2] == s2.block_table[:2] == [0, 1]
    assert bm.blocks[0].ref_count == 3 and len({s0.block_table[2], s1.block_table[2], s2.block_table[2]}) == 3


def test_finish_and_abort_return_every_block():
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    a, b, c = make_request(list(range(9))), make_request(list(range(6))), make_request([1])
    for r in (a, b, c):
        sched.add(r.seqs[0])
    run_step(sched, bm)
    sched.finish(a.seqs[0], "length")
    sched.finish(b.seqs[0], "abort")
    sched.finish(c.seqs[0], "abort")
    assert not sched.has_unfinished()
    assert bm.num_free == 16 and all(blk.ref_count == 0 for blk in bm.blocks)


def test_a_request_that_can_never_fit_is_refused():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    with pytest.raises(ValueError, match="need 5 KV blocks of 4 tokens, but the cache has 4"):
        sched.add(make_request(list(range(12)), max_tokens=5).seqs[0])
