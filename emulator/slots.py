"""Model slots: how many devices of one worker process hold a model at a time.

A device (:class:`edge_client.client.EdgeClient`, ``model_slots``) takes a slot before it fetches a
model and gives it back once it is idle again (no job running, no download under way, the model and its
client state dropped from memory). So at most ``bound`` devices of the process hold a global model,
a client state, a training model or an optimiser at once, during the rounds and after the final plan,
when every device of the fleet fetches the final model and saves its personal model. A device that
finds no slot free waits, first come first served, for one handed to it (its ``offer`` callback: False
when it stopped meanwhile, and the slot goes to the next in line).

``peak`` is the most slots held at once (instrumented: the worker's ``stats`` events report it), and
``waited`` how many times a device had to wait.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

__all__ = ["DEFAULT_MODEL_SLOTS", "ModelSlots"]

# devices per worker that hold a model at once: measured in docs/results/fleet.md (FedAvgCNN, 2.3 MB:
# about 14 MB per device training or saving; 16 keep the final phase within the rounds' memory)
DEFAULT_MODEL_SLOTS = 16

Offer = Callable[[], bool]


class ModelSlots:
    def __init__(self, bound: int) -> None:
        if bound < 1:
            raise ValueError(f"model slots must be >= 1, got {bound}")
        self.bound = bound
        self.held = self.peak = self.waited = 0
        self._waiting: deque[Offer] = deque()
        self._lock = threading.Lock()

    def acquire(self, offer: Offer) -> bool:
        """True: a slot is the caller's. False: none free; ``offer()`` is called when one is handed over."""
        with self._lock:
            if self.held < self.bound:
                self.held += 1
                self.peak = max(self.peak, self.held)
                return True
            self._waiting.append(offer)
            self.waited += 1
            return False

    def release(self) -> None:
        """A slot back: to the first waiting device that still takes it, else free."""
        with self._lock:
            while self._waiting:
                if self._waiting.popleft()():
                    return  # handed over: as many held as before
            self.held -= 1

    def cancel(self, offer: Offer) -> None:
        """The device stopped waiting."""
        with self._lock:
            try:
                self._waiting.remove(offer)
            except ValueError:
                pass

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"slots_held": self.held, "slots_peak": self.peak, "slots_waiting": len(self._waiting),
                    "slots_waited": self.waited}
