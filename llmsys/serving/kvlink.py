"""A bounded two-way channel between two ranks of a process group, for instances that serve side by side
(``disagg``): messages are queued, sent and received by threads, and a peer that dies or stays silent
longer than the timeout turns into ``PeerLost`` in the main thread instead of a hang."""

from __future__ import annotations

import datetime
import queue
import threading
import time

import torch
import torch.distributed as dist


class PeerLost(RuntimeError):
    """The other instance died, or sent nothing for longer than the peer timeout."""


class Link:
    """One end of a channel to rank ``peer``: a sender thread and a receiver thread, so this process's work never
    waits on the peer (a gloo send completes only once the peer has posted its receive, and a gloo receive's
    ``is_completed`` stays false until it is waited on, so it cannot be polled). Control messages go over
    ``control`` (a gloo group), bulk tensors over ``data``; every wait is bounded by ``peer_timeout``."""

    END = "end"  # the receiver's last message: the peer said it is done

    def __init__(self, peer: int, control, data, peer_timeout: float, kv_device: str, names: dict | None = None):
        self.peer, self.control, self.data, self.names = peer, control, data, names or {}
        self.peer_timeout, self.kv_device = peer_timeout, kv_device
        self.inbox, self.outbox = queue.Queue(), queue.Queue()
        self.last_sent = time.monotonic()
        self.sent: list[tuple[int, int]] = []  # (tag, bytes) of every message the peer has taken, in order
        self.sender = threading.Thread(target=self.send_loop, daemon=True)
        self.sender.start()

    @property
    def side(self) -> str:
        return self.names.get(self.peer, f"rank {self.peer}")

    def wait(self, work, what: str) -> None:
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.peer_timeout))
        except RuntimeError as e:
            raise PeerLost(f"{self.side} went away or did not answer for {self.peer_timeout:g} s "
                           f"while this one waited for {what}: {e}") from e

    def send(self, tensor: torch.Tensor, tag: int, data: bool = False) -> None:
        """Queue ``tensor`` for the peer (messages of one tag arrive in the order sent)."""
        self.last_sent = time.monotonic()
        self.outbox.put((tensor, tag, self.data if data else self.control))

    def send_loop(self) -> None:
        while (item := self.outbox.get()) is not None:
            tensor, tag, group = item
            try:
                self.wait(dist.isend(tensor, self.peer, group=group, tag=tag), f"it to take a message (tag {tag})")
                self.sent.append((tag, tensor.numel() * tensor.element_size()))
            except Exception as e:  # noqa: BLE001 - handed to the main thread, which raises it
                self.inbox.put(e)
                return

    def receive(self, tensor: torch.Tensor, tag: int, what: str, data: bool = False) -> torch.Tensor:
        """Receive into ``tensor`` (receiver thread only)."""
        self.wait(dist.irecv(tensor, self.peer, group=self.data if data else self.control, tag=tag), what)
        return tensor

    def start_receiving(self, receive_one) -> None:
        """Run ``receive_one(link)`` in a thread until it returns None; its messages go to ``take``."""
        def loop():
            try:
                while (message := receive_one(self)) is not None:
                    self.inbox.put(message)
                self.inbox.put(self.END)
            except Exception as e:  # noqa: BLE001 - handed to the main thread, which raises it
                self.inbox.put(e)
        threading.Thread(target=loop, daemon=True).start()

    def take(self, block: bool, what: str = ""):
        """The next message (None when ``block`` is false and there is none); a failure on either thread raises."""
        try:
            message = self.inbox.get(block, timeout=self.peer_timeout if block else None)
        except queue.Empty:
            if not block:
                return None
            raise PeerLost(f"{self.side} sent nothing for {self.peer_timeout:g} s while this one waited "
                           f"for {what}") from None
        if isinstance(message, Exception):
            raise message
        return message

    def heartbeat_due(self) -> bool:
        return time.monotonic() - self.last_sent > self.peer_timeout / 4

    def close(self) -> None:
        """Wait until everything queued has been sent."""
        self.outbox.put(None)
        self.sender.join(self.peer_timeout)
        if self.sender.is_alive():
            raise PeerLost(f"{self.side} did not take the last messages within {self.peer_timeout:g} s")
        if not self.inbox.empty() and isinstance(error := self.inbox.queue[-1], Exception):
            raise error
