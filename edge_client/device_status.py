"""What a device's status says about it (a mixin of :class:`edge_client.client.EdgeClient`).

The status is retained on ``status/<id>`` and read by the coordinator, ``flayer status`` and observers.
In a private federation (and before the first training plan, when the device cannot know yet) it carries
nothing data-dependent beyond docs/reference/private-fields.md: no training-set size, and skip reasons
generic except a spent budget.
"""

from __future__ import annotations

from typing import Any

from protocol import Status, encode_message

from .budget import BUDGET_SPENT, ROUND_SKIPPED

__all__ = ["DeviceStatus"]


class DeviceStatus:
    """Builds the signed status payload from the client's state (the worker thread calls it)."""

    # what this mixin reads of the client
    id: str
    creds: Any
    settings: Any
    device: Any
    data: Any
    plan: Any
    signer: Any
    clock: Any
    skipped: dict[int, str]
    _since: float  # the time of this connection's will: the coordinator takes no older will than it
    topics: Any
    _private_federation: bool | None
    _link_kbps: float | None
    thin: Any  # edge_client.thin.ThinUploads: the uplink rate
    _announcing: dict[str, int | float]
    _privacy_status: Any  # edge_client.budget

    def _connection_will(self) -> tuple[str, bytes]:
        """The signed will of the next connection (:class:`transport.link.MqttLink` asks before every CONNECT,
        the first and each reconnect): an ``offline`` status of now, naming itself in ``since``, as every status
        after it does until the next connection. The will of an earlier connection, put back by a party that can
        write this topic, is then older than the ``since`` the coordinator last saw and refused
        (coordinator.registry)."""
        since = max(float(self.clock()), self._since + 1e-6)  # a new mark per connection, even on a frozen clock
        self._since = since
        will = encode_message(Status(0, "offline", since, {"since": since}), self.creds.federation, self.id,
                              key=self.signer)
        return self.topics.status(self.id), will

    def _status_payload(self, state: str) -> bytes:
        private = self._private_federation is not False  # before the first training plan: as private
        info: dict[str, str | int | float | bool] = {"device": str(self.device), "client_index": self.settings.client_index,
                                                     "since": self._since}
        if not private:  # the training-set size is the device's data: not in a private federation
            info["num_train"] = self.data.num_train if self.data is not None else 0
        if self._link_kbps is not None:
            info["link_kbps"] = self._link_kbps
        thin = getattr(self, "thin", None)  # a device that fits its uploads to its link (upload = "fit"): its
        up = thin.rate if thin is not None and self.settings.upload == "fit" else None  # uplink, bytes/s
        if up is not None and up > 0:
            info["uplink_kbps"] = round(up * 8 / 1000, 1)  # a secure round's keep fraction follows it
        elif self.settings.upload == "fit":  # fits, no rate yet: its plain upload is the lowest codec's (linkfit)
            info["upload_fit"] = True  # a secure round's fit plans for that size (coordinator.secure_fit)
        if self.settings.label:
            info["label"] = self.settings.label  # the coordinator's metrics count devices by it
        if self.skipped:
            last = max(self.skipped)
            reason = self.skipped[last]
            if private and reason != BUDGET_SPENT:
                reason = ROUND_SKIPPED  # the reason stays in this device's log (docs/reference/private-fields.md)
            info.update({"skipped_round": last, "skip_reason": reason[:256]})
        info.update(self._privacy_status())
        if state == "uploading" and self._announcing:
            info.update(self._announcing)  # the upload started (edge_client.jobs, _announce)
        r = self.plan.round if self.plan is not None else 0
        return encode_message(Status(r, state, self.clock(), info), self.creds.federation, self.id, key=self.signer)
