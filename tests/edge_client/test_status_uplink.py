"""A device's status carries its uplink rate (``info.uplink_kbps``): a secure round's keep fraction follows the
selected devices' (docs/explanation/secure-aggregation.md, "Fitted to the link")."""

from __future__ import annotations

from types import SimpleNamespace

from edge_client.device_status import DeviceStatus
from protocol import decode_message
from protocol.signing import SigningKey


def _status(rate: float | None, upload: str = "fit") -> dict[str, object]:
    dev = SimpleNamespace(id="dev-1", creds=SimpleNamespace(federation="fed"), device="cpu", data=None, plan=None,
                          signer=SigningKey.generate(), clock=lambda: 1000.0, skipped={}, _since=1.0,
                          _private_federation=True, _link_kbps=None, _announcing={},
                          _privacy_status=dict, settings=SimpleNamespace(client_index=1, label="", upload=upload),
                          thin=SimpleNamespace(rate=rate))
    payload = DeviceStatus._status_payload(dev, "idle")  # type: ignore[arg-type]
    return dict(decode_message(payload)[1].info)


def test_the_status_carries_the_uplink_rate_when_the_device_knows_one():
    assert _status(1000.0)["uplink_kbps"] == 8.0  # 1,000 bytes/s
    assert "uplink_kbps" not in _status(None)  # no rate configured, no upload acknowledged yet
    assert "uplink_kbps" not in _status(1000.0, "plan")  # a device that sends the plan's codec fits nothing


def test_a_fitting_device_without_a_rate_says_it_fits():
    """Its plain upload is the lowest codec's (edge_client.linkfit): a secure round's fit plans for that size."""
    assert _status(None)["upload_fit"] is True
    assert "upload_fit" not in _status(1000.0)  # its rate says it
    assert "upload_fit" not in _status(None, "plan")  # it sends the plan's codec
