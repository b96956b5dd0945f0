"""`prefetch_iter`: batches produced in a background thread, a few ahead of the training step (an
error in the thread is raised in the consumer, at the item where it happened)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


_END = object()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


def prefetch_iter(items: Iterable[T], depth: int, pin_memory: bool = False) -> Iterator[T]:
    """Produce `items` in a background thread, up to `depth` ahead (0 = inline). The numpy gathers
    and Arrow reads release the GIL, so batches are built while the training step runs. Exceptions
    are re-raised in the consumer; leaving the loop early stops and closes the producer."""
    if depth <= 0:
        for item in items:
            yield item.pin_memory() if pin_memory else item  # type: ignore[attr-defined]
        return
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(x: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(x, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        it = iter(items)
        try:
            for item in it:
                if pin_memory:
                    item = item.pin_memory()  # type: ignore[attr-defined]
                if not put(item):
                    break
            else:
                put(_END)
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            put(_Failure(e))
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=produce, name="xmodal-batch-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            x = q.get()
            if x is _END:
                return
            if isinstance(x, _Failure):
                raise x.exc
            yield x
    finally:
        stop.set()
        thread.join(timeout=5.0)
