"""List, then watch, one kind of Kubernetes object in a daemon thread (the client blocks),
keeping the current objects by name and handing them to `publish` after each change. The
router follows its EndpointSlices and its InferenceService this way. API trouble is retried;
what was last published stays in force meanwhile."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from kubernetes import watch

log = logging.getLogger("kiln.router")

RETRY_SECONDS = 2.0  # after an API error; the last known state keeps serving meanwhile


def field(obj: Any, *path: str) -> Any:
    """A field of a typed client object or of a plain dict (custom objects come as dicts)."""
    for key in path:
        obj = obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)
        if obj is None:
            return None
    return obj


class ListWatch:
    def __init__(self, list_call: Callable[..., Any], what: str, publish: Callable[[list[Any]], None],
                 resync_seconds: int = 60, **list_args: Any) -> None:
        """`list_call(**list_args)` lists the objects (a list_namespaced_* method);
        `publish(objects)` is called in the thread after every change."""
        self._list = list_call
        self._what = what
        self._publish = publish
        self._resync_seconds = resync_seconds
        self._args = list_args
        self._objects: dict[str, Any] = {}
        self.first_look = threading.Event()  # the first list answered, or failed
        self._stopping = threading.Event()
        self._watch = watch.Watch()

    def start(self) -> None:
        threading.Thread(target=self._follow, name=f"watch[{self._what}]", daemon=True).start()

    def stop(self) -> None:
        # Watch.stop() shuts the watch's socket, so the thread leaves at once; it is a daemon
        # and touches only this object, so nobody needs to wait for it.
        self._stopping.set()
        self._watch.stop()

    def _follow(self) -> None:
        while not self._stopping.is_set():
            try:
                self._list_then_watch()
            except Exception as exc:  # noqa: BLE001 - any API trouble: retry, keep serving
                self.first_look.set()
                if self._stopping.is_set():
                    return  # stop() cut the watch short
                log.warning("%s: %s; retrying in %.0fs", self._what, exc, RETRY_SECONDS)
                self._stopping.wait(RETRY_SECONDS)

    def _list_then_watch(self) -> None:
        listed = self._list(**self._args, _request_timeout=30)
        self._objects = {field(o, "metadata", "name"): o for o in field(listed, "items") or []}
        self._publish(list(self._objects.values()))
        self.first_look.set()
        # The watch ends after resync_seconds; the loop in _follow lists afresh.
        for event in self._watch.stream(
                self._list, **self._args, resource_version=field(listed, "metadata", "resource_version")
                or field(listed, "metadata", "resourceVersion"),
                timeout_seconds=self._resync_seconds, _request_timeout=self._resync_seconds + 10):
            if self._stopping.is_set():
                return
            name = field(event["object"], "metadata", "name")
            if event["type"] == "DELETED":
                self._objects.pop(name, None)
            else:
                self._objects[name] = event["object"]
            self._publish(list(self._objects.values()))
