"""In-process transport for unit tests: every `InprocTransport` on the same bus and domain sees the others.

Delivery is synchronous, on the publisher's thread, and each subscriber gets its own deep copy (as it would
after a trip over the wire). Best-effort subscriptions can be told to drop messages, to test loss handling.

QoS matching follows DDS's request-offered rule, so that a mismatch that would lose every message on a real graph
loses them here too: a transient-local subscription hears only transient-local publishers, a reliable subscription
only reliable ones.
"""

from __future__ import annotations

import copy
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from robot.transport.base import QOS_DEFAULT, Publisher, QoS, Subscription, Transport, check_topic


class InprocBus:
    """The shared medium. One default bus per process; tests may make their own."""

    def __init__(self):
        self._lock = threading.Lock()
        self._subs: dict[tuple[int, str], list[_InprocSubscription]] = defaultdict(list)
        self._types: dict[tuple[int, str], type] = {}
        self._latched: dict[tuple[int, str], Any] = {}

    def _register_type(self, key: tuple[int, str], msg_type: type) -> None:
        known = self._types.setdefault(key, msg_type)
        if known is not msg_type:
            raise TypeError(
                f"topic {key[1]!r} already carries {known.ros_type}, not {msg_type.ros_type}"
            )

    def _reached(self, key: tuple[int, str], qos: QoS) -> list[_InprocSubscription]:
        """The subscriptions a publisher with `qos` on `key` reaches; under the lock."""
        return [s for s in self._subs[key] if qos_compatible(qos, s.qos)]

    def match_count(self, key: tuple[int, str], qos: QoS) -> int:
        with self._lock:
            return len(self._reached(key, qos))

    def deliver(self, key: tuple[int, str], msg: Any, qos: QoS) -> None:
        with self._lock:
            subs = self._reached(key, qos)
            if qos.transient_local:
                self._latched[key] = copy.deepcopy(msg)
        for sub in subs:
            sub._deliver(copy.deepcopy(msg))

    def add(self, key: tuple[int, str], sub: _InprocSubscription) -> None:
        with self._lock:
            self._subs[key].append(sub)
            last = self._latched.get(key) if sub.qos.transient_local else None
        if last is not None:
            sub._deliver(copy.deepcopy(last))

    def remove(self, key: tuple[int, str], sub: _InprocSubscription) -> None:
        with self._lock:
            if sub in self._subs[key]:
                self._subs[key].remove(sub)


DEFAULT_BUS = InprocBus()


def qos_compatible(offered: QoS, requested: QoS) -> bool:
    """DDS's request-offered matching for the two policies kinema sets: what a subscription requests must not
    exceed what the publisher offers (reliable > best-effort, transient-local > volatile)."""
    return (offered.reliable or not requested.reliable) and (offered.transient_local or not requested.transient_local)


class _InprocPublisher(Publisher):
    def __init__(self, transport: InprocTransport, topic: str, msg_type: type, qos: QoS):
        self.topic, self.msg_type, self.qos = topic, msg_type, qos
        self._transport = transport

    def publish(self, msg: Any) -> None:
        if not isinstance(msg, self.msg_type):
            raise TypeError(f"publisher on {self.topic!r} takes {self.msg_type.__name__}, got {type(msg).__name__}")
        self._transport._check_open()
        self._transport.bus.deliver((self._transport.domain_id, self.topic), msg, self.qos)

    def subscription_count(self) -> int:
        if self._transport._closed:
            return 0
        return self._transport.bus.match_count((self._transport.domain_id, self.topic), self.qos)


class _InprocSubscription(Subscription):
    def __init__(self, transport: InprocTransport, topic: str, msg_type: type, callback, qos: QoS):
        self.topic, self.msg_type, self.qos = topic, msg_type, qos
        self._transport, self._callback = transport, callback
        self.drop_next = 0  # tests: drop this many messages (best-effort only)

    def _deliver(self, msg: Any) -> None:
        if self.drop_next > 0 and not self.qos.reliable:
            self.drop_next -= 1
            return
        self._callback(msg)

    def close(self) -> None:
        self._transport.bus.remove((self._transport.domain_id, self.topic), self)


class InprocTransport(Transport):
    backend = "inproc"

    def __init__(self, bus: InprocBus | None = None, domain_id: int = 0):
        self.bus = bus or DEFAULT_BUS
        self.domain_id = domain_id
        self._closed = False
        self._subs: list[_InprocSubscription] = []

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("transport is closed")

    def publisher(self, topic: str, msg_type: type, qos: QoS = QOS_DEFAULT) -> Publisher:
        self._check_open()
        self.bus._register_type((self.domain_id, check_topic(topic)), msg_type)
        return _InprocPublisher(self, topic, msg_type, qos)

    def subscribe(
        self, topic: str, msg_type: type, callback: Callable[[Any], None], qos: QoS = QOS_DEFAULT
    ) -> Subscription:
        self._check_open()
        key = (self.domain_id, check_topic(topic))
        self.bus._register_type(key, msg_type)
        sub = _InprocSubscription(self, topic, msg_type, callback, qos)
        self._subs.append(sub)
        self.bus.add(key, sub)
        return sub

    def close(self) -> None:
        for sub in self._subs:
            sub.close()
        self._subs.clear()
        self._closed = True
