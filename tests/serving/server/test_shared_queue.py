"""`SharedQueue`: `job_queue_size` counted over several forked frontends (serving/server/shared_queue.py).

Real forked processes race for the slots of one bound: the admitted total never passes it, each
process's releases free slots for the others, and a dead frontend's slot is zeroed for its successor.
"""

from __future__ import annotations

import multiprocessing as mp
import time

from serving.server.shared_queue import SharedQueue


def _take(queue: SharedQueue, slot: int, limit: int, start, taken) -> None:  # noqa: ANN001
    queue.attach(slot)
    start.wait()
    n = 0
    while queue.try_acquire(limit):
        n += 1
    taken[slot] = n


def test_forked_frontends_never_admit_past_the_shared_bound():
    ctx = mp.get_context("fork")
    queue = SharedQueue(4)
    limit = 500
    start = ctx.Event()
    taken = ctx.Array("q", 4)
    procs = [ctx.Process(target=_take, args=(queue, slot, limit, start, taken)) for slot in range(4)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert sum(taken) == limit == queue.total()  # exactly the bound, however the four raced
    busiest, other = sorted(range(4), key=lambda s: -taken[s])[:2]
    queue.attach(busiest)  # this process takes over a slot (its frontend exited): zeroed
    assert queue.total() == limit - taken[busiest]
    assert queue.try_acquire(limit) and queue.total() == limit - taken[busiest] + 1
    queue.release()
    queue.reset(other)  # another frontend exited with its requests
    assert queue.total() == limit - taken[busiest] - taken[other]


def test_release_frees_a_slot_and_never_goes_below_zero():
    queue = SharedQueue(2).attach(1)
    assert queue.try_acquire(1) and not queue.try_acquire(1)
    queue.release()
    queue.release()  # one more than admitted (its slot was reset meanwhile): stays at 0
    assert queue.total() == 0 and queue.try_acquire(1)
    assert queue.free_slot({0, None}) == 1 and queue.free_slot(set()) == 0


def _frontend(queue: SharedQueue, admitted, release) -> None:  # noqa: ANN001
    from serving.server.admission import Admission, Health

    admission = Admission(3, lambda: Health(200, {}), reject_body=lambda path, message: {"error": message})
    admission.share(queue.attach(1))
    admitted.value = sum(admission.decide(b"POST /invocations HTTP/1.1\r\nHost: x\r\n\r\n").admitted for _ in range(2))
    release.wait(10)
    admission.release(0.1)


def test_admission_answers_503_at_the_bound_of_every_frontend_together():
    from serving.server.admission import Admission, Health

    ctx = mp.get_context("fork")
    queue = SharedQueue(2)
    admitted, release = ctx.Value("i", -1), ctx.Event()
    other = ctx.Process(target=_frontend, args=(queue, admitted, release))
    other.start()
    while admitted.value < 0 and other.is_alive():
        time.sleep(0.01)
    assert admitted.value == 2  # the other frontend holds 2 of the 3
    admission = Admission(3, lambda: Health(200, {}), reject_body=lambda path, message: {"error": message})
    admission.share(queue.attach(0))
    head = b"POST /invocations HTTP/1.1\r\nHost: x\r\n\r\n"
    assert admission.decide(head).admitted
    refused = admission.decide(head)
    assert not refused.admitted and refused.answer.startswith(b"HTTP/1.1 503") and b"capacity exceeded (3" in refused.answer
    assert admission.total_in_flight == 3
    release.set()  # one of the other frontend's requests ends
    other.join(10)
    assert admission.decide(head).admitted and admission.total_in_flight == 3


def _mark_ready(queue: SharedQueue, slot: int) -> None:
    queue.attach(slot).mark_ready()


def test_ping_says_loading_until_every_frontend_is_ready_then_stays_open():
    """A load balancer that got 200 from one frontend sends requests to all of them: /ping waits for
    the last frontend to start (a forked one here), and a frontend replaced later does not close it."""
    from serving.server.admission import Admission, Health

    queue = SharedQueue(4, frontends=2)
    admission = Admission(8, lambda: Health(200, {"status": "Healthy"}), reject_body=lambda p, m: {"error": m})
    admission.share(queue.attach(0))
    ping = b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n"
    admission.mark_ready()
    assert not queue.started and admission.decide(ping).answer.startswith(b"HTTP/1.1 503")
    assert admission.decide(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").answer.startswith(b"HTTP/1.1 503")
    other = mp.get_context("fork").Process(target=_mark_ready, args=(queue, 1))
    other.start()
    other.join(10)
    assert queue.started and admission.decide(ping).answer.startswith(b"HTTP/1.1 200")
    queue.reset(1)  # that frontend died; its replacement is starting: the others keep answering 200
    assert admission.decide(ping).answer.startswith(b"HTTP/1.1 200")


def test_a_single_process_server_is_not_held_by_the_latch():
    from serving.server.admission import Admission, Health

    admission = Admission(8, lambda: Health(200, {"status": "Healthy"}), reject_body=lambda p, m: {"error": m})
    admission.mark_ready()  # no shared queue: nothing to wait for
    assert admission.decide(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n").answer.startswith(b"HTTP/1.1 200")
