"""What an idle edge client holds, and the model slots that bound it (a mixin of
:class:`edge_client.client.EdgeClient`).

Idle, a client holds no model: once no job runs and no download is under way, it drops the global
model (kept on disk as ``global_model.bin``, :class:`edge_client.delta_fetch.HeldModel`) and its client
state (the state file holds it, :meth:`edge_client.store.DeviceStore.release`), and reads them back for
its next round. ``model_slots`` (the emulator's, one per process) bounds how many clients hold a model
at once: a client takes a slot before it fetches a model and gives it back when it is idle again; a
client that finds none free waits for one handed to it (``acquire`` returns False and later calls
``offer``, which says whether the client still takes it).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

from protocol import Plan

from .download import ModelDownload
from .store import DeviceStore, StoredState

__all__ = ["HeldSlots", "ModelSlots", "SlotFree"]


class SlotFree:
    """A model slot was handed to this client (``model_slots``): an event on its worker's queue."""


class ModelSlots(Protocol):
    """How many clients of a process hold a model at once (see the module docstring)."""

    def acquire(self, offer: Callable[[], bool]) -> bool: ...
    def release(self) -> None: ...
    def cancel(self, offer: Callable[[], bool]) -> None: ...


class HeldSlots:
    """The worker's side of the model slots; the job thread only computes with what the worker holds."""

    # what this mixin reads of the client
    events: queue.Queue[Any]
    plan: Plan | None
    store: DeviceStore
    stored: StoredState
    jobs: Any
    _busy: bool
    _download: ModelDownload | None
    _model: Any
    id: str
    _fetch: Any  # edge_client.fetch (stubs here would shadow it)
    _on_plan: Any  # edge_client.client

    def _init_slots(self, model_slots: ModelSlots | None) -> None:
        self.model_slots = model_slots
        self._slot = self._slot_wanted = self._slot_closed = False  # holding one, waiting for one, stopped
        self._slot_lock = threading.Lock()

    def _slot_free(self) -> None:
        """(worker) The slot this client waited for is its own now: the fetch that waited goes on."""
        self._slot, self._slot_wanted = True, False
        if self.plan is not None and not self._busy:
            self._on_plan(self.plan)

    def _gated_fetch(self, plan: Plan) -> None:
        """Fetch the plan's model once this client holds a model slot (at once without ``model_slots``)."""
        if self.model_slots is not None and not self._slot:
            if self._slot_wanted or not self.model_slots.acquire(self._slot_offer):
                self._slot_wanted = True
                return  # a _SlotFree event comes with the slot
            self._slot = True
        self._fetch(plan)

    def _slot_offer(self) -> bool:
        """(the slots' thread) A slot for this client: True when it takes it (it has not stopped)."""
        with self._slot_lock:
            if self._slot_closed:
                return False
            self.events.put(SlotFree())
            return True

    def _release_idle(self) -> None:
        """No job running and no download under way: drop the models and give the slot back."""
        if self._busy or self._download is not None:
            return
        self._model = None  # on disk (HeldModel): read back by the next fetch
        self.store.release(self.stored)
        if self._slot and self.model_slots is not None:
            self._slot = False
            self.model_slots.release()

    def _close_slot(self) -> None:
        """The worker stops: no slot taken any more; the one held goes back once the job (if any) ends."""
        slots = self.model_slots
        if slots is None:
            return
        with self._slot_lock:
            self._slot_closed = True
        if self._slot_wanted:
            slots.cancel(self._slot_offer)
        if not self._slot:
            return
        self._slot = False
        if not self._busy:
            slots.release()
        else:  # the job thread still computes with the model
            threading.Thread(target=lambda: (self.jobs.shutdown(wait=True), slots.release()), daemon=True,
                             name=f"edge-{self.id}-slot").start()
