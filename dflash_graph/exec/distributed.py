"""One process per rank under torchrun: transfers between ranks as torch.distributed send/recv into static,
bounded receive queues, a heartbeat per rank, and a clean stop of every rank when one is lost.

What crosses ranks, in which order, with which shape and dtype, comes from the checked graph
(`analysis.launch.cross_transfers`), so nothing about shapes is exchanged at run time (as
torch.distributed.pipelining does with its static receive buffers). Per micro-batch and replica a sender sends
its transfers in graph order, then a small header (the replica's busy and waiting seconds, for metrics); the
receiver posts the same receives in the same order. A receiving rank holds `queue` slots of receive buffers
(`queue` on the transfer nodes): a slot is posted when it is free, so a sender whose receiver has no free slot
blocks in its send, and the receiving rank holds exactly the buffers `check` counts.

Faults. Every wait runs in a helper thread while the main thread watches it: a peer whose process is gone (on the
same machine, seen at once from /proc), a peer that stops beating (frozen, or on a machine that is gone), a wait
longer than [launch] stall_timeout, a failed send/recv, or SIGTERM from the launcher (torchrun stops the other
ranks when one dies) all end in `RankLost`: a message naming the lost rank, its devices, the node it was running
and the step, written first to the rendezvous store so that every rank reports the same cause.

Ctrl-C (SIGINT to any rank, or to the whole process group from a terminal) ends in `Interrupted` on every rank,
recorded in the store like a fault, so that a rank whose peer stopped first reports the interrupt, not a lost
peer: see NOTE [Ctrl-C under torchrun].
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta

import attrs
import torch
import torch.distributed as dist

from ..analysis.launch import CrossTransfer, Launch
from ..errors import GraphError, Problem

BEAT_SECONDS = 0.5       # how often a rank publishes its heartbeat
LOST_AFTER = 5.0         # a heartbeat unchanged this long: the rank is gone (killed or frozen)
CHECK_EVERY = 0.25       # how often a waiting rank looks at the store and at its peer's process
EXIT_LOST = 4            # exit status of a rank that stopped because another rank was lost
EXIT_INTERRUPTED = 130   # 128 + SIGINT, as a shell reports Ctrl-C
HEADER = 5               # step, micro-batch, replica, busy seconds, waiting seconds
INTERRUPT = "interrupted: "   # the start of a recorded cause that is Ctrl-C, not a fault
VERDICT_WAIT = 60.0      # how long a rank that leaves a shared verdict to local rank 0 waits to be stopped
CLOSE_WAIT = 35.0        # the longest close() waits for the heartbeat's last store write (the client's timeout is 30 s)


def under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def shared_verdict(text: str, code: int) -> None:
    """Every rank reached the same verdict before any process group exists (a bad graph or flag, a launch of the
    wrong size, a predicted OOM): print it once per machine, from local rank 0, and exit `code`.

    The other ranks print nothing and wait to be stopped: torchrun stops every rank when one exits nonzero, so a
    rank that exited at once could get local rank 0 stopped before it had printed. They exit `code` quietly on
    the launcher's SIGTERM (torchrun's summary then shows `code` for every rank), or after VERDICT_WAIT seconds."""
    sys.stdout.flush()
    if os.environ.get("LOCAL_RANK", "0") == "0":
        if text:
            print(text, file=sys.stderr, flush=True)
        os._exit(code)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(code))
    signal.signal(signal.SIGINT, lambda *_: os._exit(EXIT_INTERRUPTED))
    time.sleep(VERDICT_WAIT)
    os._exit(code)


def under_verdicts(body: Callable[[dict], int], before: str) -> int:
    """A command that every rank of a launch runs (`run`, `capture`): `body(stage)` keeps stage["shared"] true until
    the process group exists. Until then every rank reaches the same verdict, so a refusal, a nonzero exit or a
    Ctrl-C "before `before`" is printed once per machine (shared_verdict), not once per rank; after it, a rank that
    stops on an error of its own records it in the rendezvous store first, so the other ranks name it instead of
    reporting a lost peer."""
    from ..errors import GraphError

    stage = {"shared": True}
    try:
        code = body(stage)
    except GraphError as e:
        if stage["shared"]:
            shared_verdict(str(e), 2)
        if record_exit(str(e).splitlines()[0]):   # another rank already printed this very error
            exit_now(2)
        raise
    except KeyboardInterrupt:
        if stage["shared"]:
            shared_verdict(f"interrupted: Ctrl-C before {before}; nothing was written", EXIT_INTERRUPTED)
        raise
    if code != 0 and stage["shared"]:
        shared_verdict("", code)
    return code


class RankLost(Exception):
    """Another rank is gone or stalled; `str()` is the message every rank prints."""


class Interrupted(Exception):
    """Ctrl-C reached this rank or another one (NOTE [Ctrl-C under torchrun]); `str()` says which."""


# NOTE [Ctrl-C under torchrun]
# Ctrl-C at a terminal sends SIGINT to the whole foreground process group: torchrun and every rank. torchrun
# forwards a second SIGINT to each rank and waits for them. Each rank's handler only sets a flag; the rank stops
# at its next node or while it waits (never inside an optimizer step), records "interrupted: ..." in the store
# (first writer wins) and raises `Interrupted`. A rank whose send or receive fails because its peer stopped first
# looks at the store and at its own flag before calling the peer lost, so the stop reads as an interrupt on every
# rank. Only the writer speaks: it saves the last completed step and prints one line; every rank exits 130.
# SIGINT to one rank alone (kill -INT) stops the run the same way, through the store.


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks since boot) of a process, from /proc; None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return rest[0], rest[19]


def _identity() -> dict:
    """What lets a rank on the same machine, in the same pid namespace, tell whether this process still exists:
    the boot id (one per kernel boot), the pid namespace and this process's start time (pids are reused)."""
    me: dict = {"pid": os.getpid(), "host": socket.gethostname()}
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            me["boot"] = f.read().strip()
        me["pidns"] = os.stat("/proc/self/ns/pid").st_ino
        stat = _proc_stat(os.getpid())
        if stat is not None:
            me["start"] = stat[1]
    except OSError:
        pass
    return me


@attrs.define
class Where:
    step: int = 0
    node: str = "(setup)"
    replica: int | None = None

    def text(self) -> str:
        rep = f", replica {self.replica}" if self.replica is not None else ""
        return f"step {self.step}, node '{self.node}'{rep}"


class _Beat(threading.Thread):
    """Publishes this rank's heartbeat (a counter, where it is) to the rendezvous store."""

    def __init__(self, store: dist.Store, rank: int, where: Where, info: dict):
        super().__init__(daemon=True, name="dflash-heartbeat")
        self.store, self.rank, self.where, self.info = store, rank, where, info
        self.count = 0
        self.state = "running"
        self.stop = threading.Event()

    def publish(self) -> None:
        self.count += 1
        w = self.where
        self.store.set(f"beat/{self.rank}", json.dumps({
            "n": self.count, "step": w.step, "node": w.node, "replica": w.replica, "state": self.state, **self.info}))

    def run(self) -> None:
        while not self.stop.wait(BEAT_SECONDS):
            try:
                self.publish()
            except Exception:      # the store is gone: the launcher is stopping; the main thread will notice
                return


class Comm:
    """This rank's side of the launch: process group, receive queues, sends, heartbeat, fault reports."""

    active: Comm | None = None     # this process's, from the process group's start to close() (record_exit)
    started = False                # a process group was started in this process: it ends by os._exit (exit_now)

    def __init__(self, launch: Launch, devices_of_rank: Mapping[int, Sequence[str]], stall_timeout: float,
                 device_type: Callable[[str], str]):
        self.launch = launch
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.devices_of_rank = {k: list(v) for k, v in devices_of_rank.items()}
        self.stall = float(stall_timeout)
        self.where = Where()
        backend = launch.backend
        self.cuda = None
        if backend == "nccl":
            self.cuda = torch.device(device_type(self.devices_of_rank[self.rank][0]))
            torch.cuda.set_device(self.cuda)
        # setup (loading weights, building models) may take long: the process group's own timeout is generous;
        # every wait in the training loop is bounded by stall_timeout instead (see _watch)
        dist.init_process_group(backend, timeout=timedelta(seconds=max(600.0, self.stall)))
        Comm.started = True
        self.groups: list = []      # the process groups made besides WORLD, in the order made (close destroys them)
        self.ctrl = self.new_group(None, "gloo") if backend != "gloo" else dist.group.WORLD
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        prefix = f"dflash/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self._store_addr = (host, port, prefix)
        self.store = self._client()
        self.me = _identity()
        info = {**self.me, "devices": self.devices_of_rank[self.rank]}
        self.beat = _Beat(self._client(), self.rank, self.where, info)
        self.beat.publish()
        self.beat.start()
        # one thread per posted receive slot (each waits for its slot) and a few for sends and the end gather
        depth = max((t.queue for t in launch.transfers if t.dst_rank == self.rank), default=1)
        self.pool = ThreadPoolExecutor(max_workers=depth + 4, thread_name_prefix="dflash-comm")
        self._terminated = False
        self.interrupted: str | None = None     # set by SIGINT: which rank was interrupted
        self._seen: dict[int, tuple[int, float]] = {}     # peer -> (last beat counter, when it last changed)
        self._last_check = 0.0
        self._handlers = {signal.SIGTERM: signal.signal(signal.SIGTERM, self._on_sigterm),
                          signal.SIGINT: signal.signal(signal.SIGINT, self._on_sigint)}
        # receive side: the slots this rank consumes, in order, and the posted ones
        self.incoming = [t for t in launch.transfers if t.dst_rank == self.rank]
        self.outgoing = [t for t in launch.transfers if t.src_rank == self.rank]
        self._posted: deque = deque()
        self._pending_slots: deque = deque()
        self.wait_seconds = 0.0
        Comm.active = self

    def new_group(self, ranks: Sequence[int] | None, backend: str):
        """A process group besides WORLD (collective: every rank of the world calls it, also those outside
        `ranks`), destroyed by close() before WORLD."""
        g = dist.new_group(ranks=None if ranks is None else sorted(ranks), backend=backend)
        self.groups.append(g)
        return g

    def _client(self) -> dist.Store:
        host, port, prefix = self._store_addr
        s = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30), wait_for_workers=False)
        return dist.PrefixStore(prefix, s)

    # -- who is where ------------------------------------------------------------------------------------------
    def _on_sigterm(self, signum, frame) -> None:
        self._terminated = True

    def _on_sigint(self, signum, frame) -> None:
        # torchrun forwards a second SIGINT after the terminal's own: one request either way
        if self.interrupted is None:
            self.interrupted = f"{INTERRUPT}Ctrl-C (SIGINT, first seen by {self._name()})"

    def _name(self, rank: int | None = None) -> str:
        rank = self.rank if rank is None else rank
        return f"rank {rank} ({', '.join(self.devices_of_rank.get(rank, []))})"

    def _stop_now(self) -> None:
        """Raise if this rank must stop at this point: Ctrl-C here, or the launcher's SIGTERM."""
        if self.interrupted is not None:
            raise self._interrupt(self.interrupted)
        if self._terminated:
            raise self._lost(None, "the launcher stopped this rank (SIGTERM)")

    def set_where(self, step: int, node: str, replica: int | None) -> None:
        w = self.where
        w.step, w.node, w.replica = step, node, replica
        self._stop_now()

    def _interrupt(self, cause: str) -> Exception:
        """Record the interrupt where every rank looks for a cause (the first recorded cause wins: a fault
        recorded before it stays the cause), and stop beating as a running rank."""
        try:
            first = self.store.compare_set("fault", "", cause).decode() or cause
        except Exception:
            first = cause
        self.beat.state = "interrupted" if first.startswith(INTERRUPT) else "failed"
        try:
            self.beat.publish()
        except Exception:
            pass
        if not first.startswith(INTERRUPT):
            return self._lost(None, first)
        return Interrupted(first[len(INTERRUPT):])

    def _peer(self, rank: int) -> dict | None:
        try:
            if not self.store.check([f"beat/{rank}"]):
                return None
            return json.loads(self.store.get(f"beat/{rank}"))
        except Exception:
            return None

    def _describe(self, rank: int, beat: dict | None) -> str:
        devs = ", ".join(self.devices_of_rank.get(rank, []))
        if beat is None:
            return self._name(rank)
        rep = f", replica {beat['replica']}" if beat.get("replica") is not None else ""
        return (f"rank {rank} ({devs}; pid {beat.get('pid')} on {beat.get('host')}) at step {beat.get('step')}, "
                f"node '{beat.get('node')}'{rep}")

    def _gone(self, beat: dict | None) -> bool | None:
        """Whether a peer's process has ended (True), is still there (False), or cannot be seen from here (None:
        another machine or pid namespace, or no /proc). A zombie not yet reaped by torchrun has ended."""
        me = self.me
        if beat is None or "boot" not in me or beat.get("boot") != me["boot"] or beat.get("pidns") != me.get("pidns"):
            return None
        stat = _proc_stat(int(beat["pid"]))
        return stat is None or stat[0] in "ZX" or (beat.get("start") is not None and stat[1] != beat["start"])

    def _gone_peers(self, ranks: Sequence[int]) -> list[tuple[int, dict]]:
        """Peers whose process ended while they were running (not after finishing or stopping on their own)."""
        out = []
        for k in ranks:
            b = self._peer(k)
            if b is not None and b.get("state") == "running" and self._gone(b):
                out.append((k, b))
        return out

    def _stale_peers(self, ranks: Sequence[int]) -> list[tuple[int, dict | None]]:
        now = time.monotonic()
        out = []
        for k in ranks:
            b = self._peer(k)
            n = b["n"] if b else -1
            last = self._seen.get(k)
            if last is None or last[0] != n:
                self._seen[k] = (n, now)
            elif now - last[1] > LOST_AFTER and (b is None or b.get("state") == "running"):
                out.append((k, b))
        return out

    def _lost_text(self, peer: int, beat: dict | None, why: str | None) -> str:
        """'lost rank K (...)': killed, when its process on this machine ended without recording a cause of its
        own (a rank that stops on an error records one first), then `why`: what this rank saw."""
        parts = []
        if beat is not None and self._gone(beat):
            parts.append("its process ended without a word: killed (SIGKILL, or the kernel's OOM killer) or crashed")
        if why:
            parts.append(why)
        return f"lost {self._describe(peer, beat)}: {'; '.join(parts) or 'no reason known'}"

    def _lost(self, peer: int | None, why: str | None) -> Exception:
        """Settle the cause (the first rank to report one wins, in the store) and build the message: `RankLost`, or
        `Interrupted` when the cause settled is Ctrl-C."""
        others = [k for k in range(self.world) if k != self.rank]
        cause = None
        if peer is not None:
            cause = self._lost_text(peer, self._peer(peer), why)
        else:
            # told to stop (SIGTERM) or a failed op without a known peer: a cause another rank recorded, else a
            # peer on this machine whose process is gone (seen at once), else a peer whose heartbeat stopped
            # (waited for only while some peer is on another machine, where its process cannot be seen)
            self.beat.state = "stopping"
            try:
                self.beat.publish()
            except Exception:
                pass
            remote = [k for k in others if self._gone(self._peer(k)) is None]
            deadline = time.monotonic() + (LOST_AFTER + 2 * BEAT_SECONDS if remote else 0.0)
            while cause is None:
                cause = self._recorded_cause()
                if cause is None:
                    gone = self._gone_peers(others)
                    if gone:
                        k, b = gone[0]
                        cause = self._lost_text(k, b, None)
                        break
                    stale = self._stale_peers(remote)
                    if stale:
                        k, b = stale[0]
                        cause = f"lost {self._describe(k, b)}: its heartbeat stopped ({why})"
                if time.monotonic() >= deadline:
                    break
                time.sleep(BEAT_SECONDS / 2)
            if cause is None:
                cause = (f"stopped: {why}, while every rank was running: torchrun itself was told to stop"
                         if not remote and self._terminated else f"stopped: {why}")
        try:
            first = self.store.compare_set("fault", "", cause).decode()
        except Exception:
            first = cause
        first = first or cause
        if first.startswith(INTERRUPT):
            return self._interrupt(first)
        self.beat.state = "failed"
        return RankLost(f"{self._name()} stops at {self.where.text()}: {first}")

    def fail(self, cause: str) -> str:
        """This rank stops the run for a reason of its own (non-finite steps, a failed write): record the cause
        where every rank looks for one, so the others stop at their next wait naming it, not a lost peer. Returns
        the cause recorded (another rank's, if one was recorded first)."""
        try:
            first = self.store.compare_set("fault", "", cause).decode() or cause
        except Exception:
            first = cause
        self.beat.state = "failed"
        try:
            self.beat.publish()
        except Exception:
            pass
        return first

    def _recorded_cause(self) -> str | None:
        try:
            if self.store.check(["fault"]):
                return self.store.get("fault").decode() or None
        except Exception:
            return None
        return None

    def _watch(self, fut: Future, peer: int | Sequence[int], what: str, stall: bool = True) -> None:
        """Wait for a send or receive (running in a pool thread) while watching the peer (or each of several, for a
        collective) and the clock (stall=False: no stall_timeout, for a setup wait as long as the peer's loading
        takes, still ended by a recorded cause or a lost heartbeat)."""
        peers = [peer] if isinstance(peer, int) else list(peer)
        t0 = time.monotonic()
        deadline = t0 + self.stall
        while True:
            try:
                fut.result(timeout=0.05)
                self.wait_seconds += time.monotonic() - t0
                return
            except FutureTimeout:
                pass
            except Exception as e:      # the op failed: the connection to the peer is gone
                raise self._failed(peers, f"{what} failed on rank {self.rank} ({_short(e)})") from None
            self._stop_now()
            now = time.monotonic()
            if now - self._last_check > CHECK_EVERY:
                self._last_check = now
                cause = self._recorded_cause()
                if cause:
                    raise self._interrupt(cause) if cause.startswith(INTERRUPT) else self._lost(None, cause)
                gone = self._gone_peers(peers)
                if gone:
                    raise self._lost(gone[0][0], None)
                stale = self._stale_peers(peers)
                if stale:
                    raise self._lost(stale[0][0], f"no heartbeat for {LOST_AFTER:.0f} s while rank {self.rank} "
                                                  f"waited on {what}")
            if stall and now > deadline:
                raise self._lost(peers[0], f"rank {self.rank} waited on {what} for longer than stall_timeout = "
                                       f"{self.stall:g} s ([launch])")

    def _failed(self, peer: int | Sequence[int], why: str) -> Exception:
        """A send or receive failed: the peer stopped. Why it stopped decides what this rank reports: Ctrl-C here
        or there (the peer exits at once, so its connection closes before this rank sees the interrupt), a cause
        recorded by another rank, or else the peer is lost (of several, the one whose process is gone)."""
        peers = [peer] if isinstance(peer, int) else list(peer)
        if self.interrupted is not None:
            return self._interrupt(self.interrupted)
        deadline = time.monotonic() + 2 * CHECK_EVERY   # the peer records its cause before it exits; wait for it a moment
        while True:
            cause = self._recorded_cause()
            if cause:
                return self._interrupt(cause) if cause.startswith(INTERRUPT) else self._lost(None, cause)
            if self.interrupted is not None:
                return self._interrupt(self.interrupted)
            if time.monotonic() >= deadline:
                gone = self._gone_peers(peers)
                return self._lost(gone[0][0] if gone else peers[0], why)
            time.sleep(CHECK_EVERY / 4)

    # -- receive queues ---------------------------------------------------------------------------------------
    def plan_slots(self, start_step: int, steps: int, accum: int, replicas: int) -> None:
        """The slots this rank will consume, in the order it consumes them: (step, micro-batch, replica)."""
        reps = sorted({t.replica for t in self.incoming})
        self._pending_slots = deque((s, a, r) for s in range(start_step, steps) for a in range(accum) for r in reps)
        self.queue = max((t.queue for t in self.incoming), default=1)

    def _post(self, alloc: Callable[[CrossTransfer], torch.Tensor]) -> None:
        while self._pending_slots and len(self._posted) < self.queue:
            step, a, r = self._pending_slots.popleft()
            works, bufs, headers = [], {}, {}
            for t in (t for t in self.incoming if t.replica == r):
                buf = alloc(t)
                bufs[t.node] = buf
                works.append(self._p2p(dist.irecv, buf, t.src_rank, None, f"posting the receive of '{t.node}'"))
            for src in sorted({t.src_rank for t in self.incoming if t.replica == r}):
                h = torch.zeros(HEADER, dtype=torch.float64)
                headers[src] = h
                works.append(self._p2p(dist.irecv, h, src, self.ctrl, "posting the receive of a header"))
            fut = self.pool.submit(self._complete, works)
            self._posted.append(((step, a, r), fut, bufs, headers))

    def _p2p(self, op, tensor: torch.Tensor, peer: int, group, what: str):
        """Start an isend/irecv; a peer already gone makes gloo raise at once, which is a lost rank too."""
        try:
            if group is None or group is dist.group.WORLD:
                return op(tensor, peer)
            return op(tensor, peer, group=group)
        except Exception as e:
            raise self._failed(peer, f"{what} failed on rank {self.rank} ({_short(e)})") from None

    def _complete(self, works) -> None:
        """Runs in a pool thread. On NCCL, Work.wait() only orders the compute stream after the transfer; the
        device is synchronized too, so that a wait ends when the data is really here (or sent) and a lost peer is
        seen as a wait that does not end, not as a later hang inside a kernel."""
        for w in works:
            w.wait()
        if self.cuda is not None:
            torch.cuda.synchronize(self.cuda)

    def receive(self, step: int, a: int, r: int, alloc: Callable[[CrossTransfer], torch.Tensor]) -> tuple[dict, dict]:
        """The received tensors of slot (step, a, r) (node id -> tensor) and the senders' headers."""
        self._post(alloc)
        key, fut, bufs, headers = self._posted[0]
        if key != (step, a, r):
            raise RuntimeError(f"receive order broken: expected slot {key}, asked for {(step, a, r)}")
        srcs = sorted(headers)
        self._watch(fut, srcs[0], f"the batch of replica {r} from rank {srcs[0]}")
        self._posted.popleft()
        for src, h in headers.items():
            if (int(h[0]), int(h[1]), int(h[2])) != (step, a, r):
                raise RankLost(f"rank {self.rank}: rank {src} sent the batch of step {int(h[0])}, micro-batch "
                               f"{int(h[1])}, replica {int(h[2])} where step {step}, micro-batch {a}, replica {r} "
                               "was expected: the ranks run different graphs or flags")
        return bufs, {src: (float(h[3]), float(h[4])) for src, h in headers.items()}

    def release(self, alloc: Callable[[CrossTransfer], torch.Tensor]) -> None:
        """A slot's batch is done with: post the next slot's receives (a sender blocked on this queue goes on)."""
        self._post(alloc)

    # -- send side --------------------------------------------------------------------------------------------
    def send(self, x: torch.Tensor, t: CrossTransfer) -> None:
        if not x.is_contiguous():
            x = x.contiguous()      # staging copy; every op in the catalog returns contiguous tensors
        work = self._p2p(dist.isend, x, t.dst_rank, None, f"sending '{t.node}'")
        self._watch(self.pool.submit(self._complete, [work]), t.dst_rank, f"sending '{t.node}' of replica {t.replica} to rank "
                    f"{t.dst_rank}")

    def send_header(self, step: int, a: int, r: int, busy: float, wait: float) -> None:
        for dst in sorted({t.dst_rank for t in self.outgoing if t.replica == r}):
            h = torch.tensor([step, a, r, busy, wait], dtype=torch.float64)
            work = self._p2p(dist.isend, h, dst, self.ctrl, "sending a header")
            self._watch(self.pool.submit(self._complete, [work]), dst, f"the header of replica {r} to rank {dst}")

    # -- small control messages (setup and the end) ------------------------------------------------------------
    def exchange(self, tensors: Sequence[torch.Tensor], peer: int, send: bool, what: str) -> None:
        """Send `tensors` (contiguous, on the CPU) to `peer`, or receive into them, over the control group, as bytes,
        watched (no stall_timeout): an exchange outside the training stream that must not queue behind a data
        receive already posted on that pair (NCCL)."""
        op = dist.isend if send else dist.irecv
        works = [self._p2p(op, x.reshape(-1).view(torch.uint8), peer, self.ctrl, what) for x in tensors]
        self._watch(self.pool.submit(self._complete, works), peer, what, stall=False)

    def broadcast(self, obj, src: int, what: str = "a broadcast"):
        """`src`'s obj on every rank. Watched (a setup wait: no stall_timeout), so a source that stops with an
        error of its own (Comm.fail) ends it with that error rather than a broken connection."""
        box = [obj]
        fut = self.pool.submit(dist.broadcast_object_list, box, src, self.ctrl)
        # the source watches too: a rank that stopped on an error of its own breaks the broadcast
        peer = src if self.rank != src else next(k for k in range(self.world) if k != src)
        self._watch(fut, peer, what, stall=False)
        return box[0]

    def gather(self, obj, dst: int) -> list | None:
        out = [None] * self.world if self.rank == dst else None
        fut = self.pool.submit(dist.gather_object, obj, out, dst, self.ctrl)
        self._watch(fut, dst, "the end-of-run gather")
        return out

    def close(self) -> None:
        """The end of a rank that finished: nothing of the launch may outlive it (NOTE [Teardown]). The heartbeat
        says "done" and its thread is joined, the helper threads are joined, every process group is destroyed
        (those made besides WORLD first, in reverse order, then WORLD), this object lets go of them and the
        signal handlers are given back. Idempotent."""
        if Comm.active is not self:
            return
        Comm.active = None
        self.beat.state = "done"
        try:
            self.beat.publish()
        except Exception:
            pass
        self.beat.stop.set()
        self.beat.join(timeout=CLOSE_WAIT)
        # every receive posted was consumed and every send waited for (plan_slots is exact), so the pool is idle;
        # a wait that never ends is not waited for here (it would hold the exit; os._exit ends it)
        self.pool.shutdown(wait=not self._posted, cancel_futures=True)
        try:
            for g in reversed(self.groups):
                if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
                    dist.destroy_process_group(g)
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
        self.groups.clear()
        self.ctrl = None
        for sig, handler in self._handlers.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


# NOTE [Teardown]
# "terminate called without an active exception" (SIGABRT, exit -6) after a run had finished and printed its summary:
# a thread other than the main one asked for the GIL while the interpreter was finalizing. CPython 3.11 ends such a
# thread with pthread_exit; its forced unwind reaches a C++ destructor (noexcept), and std::terminate aborts the
# process, so torchrun reports a failed launch. Two kinds of thread were alive at finalization:
# - the heartbeat (a daemon thread): close() set its stop event and returned, and a rank with nothing left to do
#   (a target rank) could reach finalization while the thread was still inside TCPStore.set with the GIL
#   released; pybind11 takes the GIL back as set returns (tools/exit_aborts.py reproduces it);
# - gloo's worker and transport threads (pt_gloo_runloop, gloo_tcp_loop): destroy_process_group() takes a group
#   out of torch's tables, but the group and its threads live on while anything holds it, and
#   DistributedDataParallel leaves a reference in torch's C++ that outlives the DDP object, the group object and
#   destroy_process_group (torch 2.13: a group that a DDP was built on still has its gloo threads after all three
#   are gone and gc.collect() ran; one no DDP used has none). A worker that drops the last reference to a tensor
#   Python let go of takes the GIL to free it (pytorch/pytorch#190489).
# So close() joins the heartbeat and the helper threads and destroys every group while the interpreter is whole,
# and a rank then ends by os._exit (end_rank), output flushed: no finalization runs, so no thread torch still
# holds can meet it. A rank that stops on an error ended that way already (exit_now).


def end_rank(code: int) -> None:
    """The end of `python -m dflash_graph` in a process that started a launch's process group (nothing to do in
    one process): a rank that finished (0) closes its Comm if a path returned without closing it (a resume of a
    finished run), then every rank ends by os._exit with `code` (NOTE [Teardown])."""
    if not Comm.started:
        return
    if code == 0 and Comm.active is not None:
        Comm.active.close()
    exit_now(code)


def record_exit(why: str) -> bool:
    """This rank is about to exit on an error of its own: record it where the other ranks look for a cause, so
    that they name it rather than report this rank lost (a cause recorded before stays the cause). True when
    another rank recorded the very same error first (two target ranks that read the same bad corpus): this rank
    need not print it again."""
    comm = Comm.active
    if comm is None or comm.beat.state != "running":
        return False
    said = " stopped the run: "
    first = comm.fail(f"{comm._name()}{said}{why}")
    return first.startswith("rank ") and first.split(said, 1)[-1] == why and not first.startswith(comm._name() + said)


def exit_now(code: int) -> None:
    """The end of a rank: a nonzero exit's cause recorded (a rank that printed an internal error, exit 3, records
    that much), output flushed, and os._exit: no wait for a helper thread still blocked on a dead peer, and no
    interpreter finalization for a thread torch still holds to meet (NOTE [Teardown]). Nothing to do before the
    process group exists, or in one process."""
    if not Comm.started:
        return
    if code:
        record_exit(f"it exited with status {code} (its own message says why)")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _short(e: BaseException) -> str:
    """gloo's and NCCL's errors start with a source path: keep the words ('Connection reset by peer')."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    if "] " in text and text.startswith("["):
        text = text.split("] ", 1)[1]
    return text.split(". ")[0][:120]


def parallel_model(typed) -> tuple[str | None, str | None]:
    """The trainable model and the `parallel` it declares ("ddp", "fsdp", or None: one rank owns it)."""
    for name, m in typed.ctx.spec.models.items():
        if m.trainable:
            return name, getattr(m, "parallel", None)
    return None, None


def replica_group(comm: Comm, ranks: Sequence[int]):
    """The process group of a data-parallel model's ranks, on the launch's backend. Every rank of the world calls
    this (new_group is collective over the world, also for the ranks outside it); the DDP wrapper, the metrics
    gather and the sharded checkpoint run on it. comm.close() destroys it."""
    return comm.new_group(ranks, comm.launch.backend)


def gather_among(comm: Comm, obj, group, ranks: Sequence[int], what: str) -> list:
    """Every member's obj, in rank order, on every member of `group` (its ranks `ranks`). Watched like every
    other wait (Comm._watch): a member that is killed or stops on an error ends it with that cause."""
    out = [None] * len(ranks)
    fut = comm.pool.submit(dist.all_gather_object, out, obj, group)
    peer = next((k for k in ranks if k != comm.rank), comm.rank)
    comm._watch(fut, peer, what)
    return out


def gather_watching_all(comm: Comm, obj, dst: int, what: str) -> list | None:
    """gather_object to `dst` on the control group, watching every other rank while it waits and without
    stall_timeout (the ranks reach it when their own work is done, which may take hours: `capture`'s final
    gather): a rank killed meanwhile, or whose heartbeat stops, or that records a cause, ends the wait on every
    rank with a message that names it. Returns the gathered objects on `dst`, None elsewhere."""
    out = [None] * comm.world if comm.rank == dst else None
    fut = comm.pool.submit(dist.gather_object, obj, out, dst, comm.ctrl)
    comm._watch(fut, [k for k in range(comm.world) if k != comm.rank], what, stall=False)
    return out


def writer_ranks(typed, launch: Launch) -> set[int]:
    """The ranks that run a node of the trainable model (one, in a launch that can run)."""
    from ..analysis.launch import device_for
    from ..analysis.nodecost import grad_nodes

    return {launch.devices[device_for(typed, typed.graph[n].device, r)].rank for n in grad_nodes(typed)
            for r in range(launch.replicas)}


def check_launch(typed, launch: Launch, writers: set[int] | None = None) -> None:
    """What torchrun cannot run, refused before any process group exists (every rank reaches the same verdict)."""
    from ..analysis.nodecost import grad_nodes

    spec = typed.ctx.spec
    writers = writer_ranks(typed, launch) if writers is None else writers
    world = int(os.environ.get("WORLD_SIZE", "1"))
    problems = []
    if world != launch.world_size:
        ranks = ", ".join(f"{d}={launch.devices[d].rank}" for d in launch.devices)
        problems.append(Problem(
            f"torchrun started {world} processes, but the graph's devices map to {launch.world_size} rank(s) ({ranks})",
            spec.loc("devices"), hint=f"launch with --nproc-per-node {launch.world_size} (dflash-graph launch or "
                                      "torchrun, one machine), or declare `rank` on each device to share ranks"))
    if len(writers) > 1:
        name, mode = parallel_model(typed)
        if mode is None:
            problems.append(Problem(f"the trainable model's nodes run on ranks {sorted(writers)}; without `parallel` "
                                    "one rank must own all of them (it steps the optimizer and writes the checkpoints)",
                                    spec.loc("models", name) if name else spec.loc("devices"),
                                    expected="one rank, or parallel = \"ddp\" on the model",
                                    actual=f"{len(writers)} ranks and no parallel",
                                    hint=f"declare parallel = \"ddp\" in [models.{name}] (one replica per rank, "
                                         "gradients averaged), or give the drafter's devices one rank"))
    grads = grad_nodes(typed)
    by_dst: dict[tuple[int, int], set[int]] = {}
    for t in launch.transfers:
        if t.node in grads and typed.graph[t.node].inputs[0][1].node in grads:
            problems.append(Problem(f"transfer '{t.node}' carries a tensor that needs gradients from rank "
                                    f"{t.src_rank} to rank {t.dst_rank}; gradients do not flow between ranks",
                                    typed.ctx.loc(typed.graph[t.node]), hint="put the trainable nodes on one rank"))
        by_dst.setdefault((t.dst_rank, 0), set()).add(t.queue)
        kinds = {spec.devices[t.src_device].torch.split(":")[0], spec.devices[t.dst_device].torch.split(":")[0]}
        if len(kinds) > 1:
            problems.append(Problem(f"transfer '{t.node}' goes from {t.src_device} ({spec.devices[t.src_device].torch}) "
                                    f"to {t.dst_device} ({spec.devices[t.dst_device].torch}) across ranks: send/recv "
                                    "needs both ends on the same kind of device", typed.ctx.loc(typed.graph[t.node]),
                                    hint="map both devices to CUDA (nccl) or both to CPU (gloo), e.g. --device-map "
                                         "'cuda:*=cpu'"))
    for (dst, _), qs in by_dst.items():
        if len(qs) > 1:
            node = next(t.node for t in launch.transfers if t.dst_rank == dst)
            problems.append(Problem(f"transfers into rank {dst} declare different queue depths {sorted(qs)}; a rank "
                                    "holds one queue of whole batches", typed.ctx.loc(typed.graph[node], "params"),
                                    hint="give every transfer into that rank the same params.queue"))
    if problems:
        raise GraphError(problems)
