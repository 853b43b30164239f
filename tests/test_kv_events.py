"""The gateway's KV-event subscriber against the sim engine's publisher: replay on join, replay on a
sequence gap, rebuild on restart and when replay cannot cover the gap.

Lost batches are made deterministically: a :class:`LossyPublisher` drops a burst on its PUB socket
(as a full ZMQ pipe would) while still numbering and buffering it for replay, and the tests wait
until the publisher thread has handled the whole burst. Waits poll a condition with a deadline.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from types import SimpleNamespace

import pytest
import zmq
import zmq.asyncio

from engines_adapters.kv_events import KVEventSubscriber, subscriber_address
from engines_adapters.kv_wire import BlockStored, publisher_binds
from engines_adapters.net import free_port
from engines_adapters.sim.publisher import KVEventPublisher
from scheduler.hashing import block_hashes, vllm_block_hashes
from scheduler.hit_index import HitIndex

BS = 16


def stored(tokens: list[int], parent: int | None) -> tuple[BlockStored, int]:
    ids = vllm_block_hashes(tokens, BS, seed_text="0")
    return BlockStored(block_hashes=ids, parent_block_hash=parent, token_ids=tokens, block_size=BS,
                       lora_id=None, medium="GPU", lora_name=None), ids[-1]


def chain(n_batches: int, salt: int) -> list[tuple[list[int], BlockStored]]:
    """n batches each storing one block of one growing sequence (so each needs its parent)."""
    out, parent, tokens = [], None, []
    for i in range(n_batches):
        block = [(salt * 7919 + i * 31 + j) % 256 for j in range(BS)]
        tokens = tokens + block
        ev, parent = stored(block, parent)
        out.append((list(tokens), ev))
    return out


async def until(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.01)


async def nudge_until(pub: KVEventPublisher, cond, tries: int = 300) -> None:
    """Publish empty batches until ``cond``: a batch dropped before the engine's (re)connection
    carried our subscription is only noticed as a gap when a later batch arrives. Bounded at
    15 s: a replay round trip on a loaded 2-core machine can take seconds."""
    for _ in range(tries):
        if cond():
            return
        pub.publish(time.time(), [])
        await asyncio.sleep(0.05)
    assert cond()


class _LossyPubSocket:
    """The publisher's PUB socket, losing every batch sent while ``lose`` is set."""

    def __init__(self, sock: zmq.Socket, lose: threading.Event):
        self._sock, self._lose = sock, lose

    def send_multipart(self, frames) -> None:
        if not self._lose.is_set():
            self._sock.send_multipart(frames)

    def close(self) -> None:
        self._sock.close()


class LossyPublisher(KVEventPublisher):
    """The sim engine's publisher on a network that loses batches on demand: what a subscriber
    sees when a burst overflows the ZMQ pipe, but the same every run."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.lose = threading.Event()

    def _open(self):
        pub, replay = super()._open()
        return _LossyPubSocket(pub, self.lose), replay


async def lose_burst(pub: LossyPublisher, batches: list[BlockStored]) -> None:
    """Publish ``batches`` so that none reaches a subscriber live (all stay in the replay buffer)."""
    pub.lose.set()
    target = pub.published + len(batches)
    for ev in batches:
        pub.publish(time.time(), [ev])
    await until(lambda: pub.published == target)
    pub.lose.clear()


def held_blocks(index: HitIndex, tokens: list[int]) -> int:
    return index.match(block_hashes(tokens, BS)).device.get("e", 0)


@pytest.fixture
def endpoints():
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def run_case(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


@contextlib.asynccontextmanager
async def wired(ep: str, rep: str, *, subscribe: bool = True, idle_probe_s: float = 1.0, **pub_kw):
    """A hit index fed by a subscriber on (ep, rep) and a sim-engine publisher; torn down after."""
    env = SimpleNamespace(index=HitIndex(BS), ctx=zmq.asyncio.Context(), sub=None, task=None,
                          pub=LossyPublisher(ep, rep, **pub_kw))
    env.index.register("e")

    def start_subscriber() -> None:
        env.sub = KVEventSubscriber(env.ctx, "e", ep, env.index, replay_endpoint=rep, idle_probe_s=idle_probe_s)
        env.task = asyncio.create_task(env.sub.run())

    env.start_subscriber = start_subscriber
    if subscribe:
        start_subscriber()
    env.pub.start()
    try:
        yield env
    finally:
        if env.task is not None:
            env.task.cancel()
            await asyncio.gather(env.task, return_exceptions=True)
        env.pub.close()
        env.ctx.term()


def test_bind_connect_rule_mirrors_vllm():
    assert publisher_binds("tcp://*:5557") and publisher_binds("ipc:///tmp/x") and publisher_binds("tcp://[::]:5557")
    assert not publisher_binds("tcp://127.0.0.1:5557")
    assert subscriber_address("tcp://*:5557", "http://127.0.0.1:8000") == "tcp://127.0.0.1:5557"


def test_late_joiner_replays_history_then_follows_live(endpoints):
    async def case():
        async with wired(*endpoints, subscribe=False) as env:
            batches = chain(5, salt=1)
            for _, ev in batches[:3]:  # published before anyone listens: lost on the PUB socket
                env.pub.publish(time.time(), [ev])
            await until(lambda: env.pub.published == 3)
            env.start_subscriber()
            await until(lambda: held_blocks(env.index, batches[2][0]) == 3)
            assert env.sub.stats.replays >= 1
            for _, ev in batches[3:]:
                env.pub.publish(time.time(), [ev])
            await nudge_until(env.pub, lambda: held_blocks(env.index, batches[4][0]) == 5)

    run_case(case())


def test_gap_is_filled_by_replay(endpoints):
    async def case():
        async with wired(*endpoints) as env:
            batches = chain(60, salt=2)
            env.pub.publish(time.time(), [batches[0][1]])
            await nudge_until(env.pub, lambda: held_blocks(env.index, batches[0][0]) == 1)
            await lose_burst(env.pub, [ev for _, ev in batches[1:]])
            # the next live batch shows the subscriber the gap; replay fills it
            await nudge_until(env.pub, lambda: held_blocks(env.index, batches[-1][0]) == 60)
            assert env.sub.stats.gaps >= 1 and env.sub.stats.rebuilds == 0

    run_case(case())


def test_restart_rebuilds_from_the_new_incarnation(endpoints):
    ep, rep = endpoints

    async def case():
        async with wired(ep, rep) as env:
            old = chain(3, salt=3)
            for _, ev in old:
                env.pub.publish(time.time(), [ev])
            await nudge_until(env.pub, lambda: held_blocks(env.index, old[-1][0]) == 3)
            for _ in range(30):  # the old engine's sequence runs well ahead of the new one's
                env.pub.publish(time.time(), [])
            await nudge_until(env.pub, lambda: env.sub.stats.last_seq >= 32)
            env.pub.close()
            # the engine restarts: its sequence begins at 0 again and its cache is empty
            for _ in range(100):  # the old sockets' ports are released asynchronously
                env.pub = KVEventPublisher(ep, rep)
                try:
                    env.pub.start()
                    break
                except RuntimeError:
                    await asyncio.sleep(0.05)
            new = chain(2, salt=4)
            env.pub.publish(time.time(), [new[0][1]])
            await nudge_until(env.pub, lambda: held_blocks(env.index, new[0][0]) == 1)
            assert held_blocks(env.index, old[-1][0]) == 0 and env.sub.stats.rebuilds == 1

    run_case(case())


def test_gap_beyond_the_replay_buffer_rebuilds(endpoints):
    async def case():
        async with wired(*endpoints, buffer_steps=2) as env:
            # subscribed first: a first batch lost to the slow join would be noticed only after the
            # nudges had pushed it out of the 2-batch buffer, and the rebuild would forget it
            await nudge_until(env.pub, lambda: env.sub.stats.lag_n >= 1)
            first = chain(1, salt=5)[0]
            env.pub.publish(time.time(), [first[1]])
            await nudge_until(env.pub, lambda: held_blocks(env.index, first[0]) == 1)
            rebuilds = env.sub.stats.rebuilds  # the slow join may have cost one already
            await lose_burst(env.pub, [ev for _, ev in chain(40, salt=6)])  # a 2-batch buffer cannot cover it
            await nudge_until(env.pub, lambda: env.sub.stats.rebuilds > rebuilds)
            # the rebuilt instance holds nothing from before the gap: no stale state survives
            assert held_blocks(env.index, first[0]) == 0

    run_case(case())


def test_resync_drops_and_rebuilds_from_replay(endpoints):
    async def case():
        async with wired(*endpoints) as env:
            batches = chain(4, salt=7)
            for _, ev in batches:
                env.pub.publish(time.time(), [ev])
            await nudge_until(env.pub, lambda: held_blocks(env.index, batches[-1][0]) == 4)
            env.index.drop_instance("e")  # pretend the index lost track; resync must restore it
            env.sub.resync()
            await until(lambda: env.sub.stats.rebuilds == 1 and held_blocks(env.index, batches[-1][0]) == 4)

    run_case(case())


def test_idle_probe_recovers_a_lost_tail_without_later_batches(endpoints):
    async def case():
        async with wired(*endpoints, idle_probe_s=0.2) as env:
            batches = chain(30, salt=8)
            env.pub.publish(time.time(), [batches[0][1]])
            await nudge_until(env.pub, lambda: held_blocks(env.index, batches[0][0]) == 1)
            await lose_burst(env.pub, [ev for _, ev in batches[1:]])  # and nothing is published after it
            await until(lambda: held_blocks(env.index, batches[-1][0]) == 30)
            assert env.sub.stats.tail_recoveries >= 1 and env.sub.stats.rebuilds == 0

    run_case(case())


def test_the_sockets_fd_wakes_the_subscriber_for_a_batch_and_is_quiet_while_idle(endpoints):
    """The loop watches the SUB socket's FD itself: a batch arriving wakes the waiting
    subscriber through it (not only the bounded wait's timer), and an idle socket's FD does not
    call back turn after turn (ZMQ's FD stays readable until EVENTS is read)."""
    ep, rep = endpoints

    class Counting(KVEventSubscriber):
        fd_calls = woke = 0

        def _on_fd(self, sub) -> None:
            self.fd_calls += 1
            waiting = self._waiter is not None and not self._waiter.done()
            super()._on_fd(sub)
            self.woke += waiting and self._waiter.done()

    async def case():
        index, ctx, pub = HitIndex(BS), zmq.asyncio.Context(), KVEventPublisher(ep, rep)
        index.register("e")
        sub = Counting(ctx, "e", ep, index, replay_endpoint=rep, idle_probe_s=60)
        task = asyncio.create_task(sub.run())
        pub.start()
        try:
            batches = chain(2, salt=9)
            pub.publish(time.time(), [batches[0][1]])
            await nudge_until(pub, lambda: held_blocks(index, batches[0][0]) == 1)
            calls = sub.fd_calls
            await asyncio.sleep(0.3)  # idle: a spinning callback would run thousands of times
            assert sub.fd_calls - calls < 20
            woke = sub.woke
            pub.publish(time.time(), [batches[1][1]])
            await until(lambda: held_blocks(index, batches[1][0]) == 2)
            await nudge_until(pub, lambda: sub.woke > woke)  # (a batch can land between two waits)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            pub.close()
            ctx.term()

    run_case(case())
