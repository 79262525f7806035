"""The LoRA adapters an engine serves: every name requests may use, with its PEFT folder, and the
weights of at most `capacity` of them (vLLM's --max-cpu-loras). Loading one more unloads the least
recently used adapter no request holds; a request naming it later has it read again from its folder.

An adapter held by a waiting or running request (its Sequence keeps the weights) is never unloaded.
With every loaded adapter held, a load fails with LoRACapacityError (the server's 429) instead of
waiting: the engine thread that would wait is the one whose steps finish those requests."""
from __future__ import annotations

from collections.abc import Callable, Iterable

from kiln.engine.lora import LoRAAdapter


class LoRACapacityError(RuntimeError):
    """Every loaded adapter is held by a request: none can make room for another."""


class LoRACache:
    def __init__(self, capacity: int, load: Callable[[str, str], LoRAAdapter],
                 unload: Callable[[LoRAAdapter], None], held: Callable[[], Iterable[LoRAAdapter | None]]) -> None:
        """load: read an adapter (name, folder) for the runner; unload: tell the runner it is gone;
        held: the adapters of the engine's unfinished requests."""
        self.capacity = capacity
        self.paths: dict[str, str] = {}  # every adapter requests may name -> its PEFT folder
        self.loaded: dict[str, LoRAAdapter] = {}  # those whose weights are loaded, least recently used first
        self.retiring: list[LoRAAdapter] = []  # unloaded by name, still held by requests admitted before
        self._load, self._unload, self._held = load, unload, held

    def get(self, name: str) -> LoRAAdapter:
        """A served adapter's weights (KeyError for a name not served), read again if they were
        unloaded for room; it becomes the most recently used."""
        adapter = self.loaded.pop(name, None) or self._read(name, self.paths[name])
        self.loaded[name] = adapter
        return adapter

    def add(self, name: str, path: str) -> LoRAAdapter:
        """Serve the adapter in `path` under `name`; one already of that name is removed once the
        new one has loaded (a folder that cannot load leaves it serving, read again when named)."""
        old = self.loaded.get(name)
        if old is not None and id(old) not in self._held_ids():
            self._unload(self.loaded.pop(name))  # its room is the new one's, not another adapter's
        adapter = self._read(name, path)
        if name in self.paths:
            self.remove(name)
        self.paths[name] = path
        self.loaded[name] = adapter
        return adapter

    def remove(self, name: str) -> int:
        """Stop serving `name` (KeyError if not served): requests holding it finish with it, its
        weights going with the last of them. Returns how many requests hold it."""
        if self.paths.pop(name, None) is None:
            raise KeyError(f"no LoRA adapter named {name!r} is loaded")
        adapter = self.loaded.pop(name, None)
        if adapter is None:  # unloaded for room, so no request held it
            return 0
        self.retiring.append(adapter)
        self.retire()
        return sum(held is adapter for held in self._held())

    def retire(self) -> None:
        """Free the removed adapters that no request holds any more."""
        if self.retiring:
            held = self._held_ids()
            for adapter in [a for a in self.retiring if id(a) not in held]:
                self.retiring.remove(adapter)
                self._unload(adapter)

    def _read(self, name: str, path: str) -> LoRAAdapter:
        """Load an adapter once there is room: the retiring ones count, as their weights are loaded too."""
        self.retire()
        held = self._held_ids()
        while len(self.loaded) + len(self.retiring) >= self.capacity:
            idle = next((n for n, adapter in self.loaded.items() if id(adapter) not in held), None)
            if idle is None:
                raise LoRACapacityError(
                    f"LoRA adapter {name!r} cannot be loaded: all {self.capacity} loaded adapters (--max-cpu-loras) "
                    "are in use by requests; retry once some finish")
            self._unload(self.loaded.pop(idle))
        return self._load(name, path)

    def _held_ids(self) -> set[int]:
        return {id(adapter) for adapter in self._held()}
