"""A secure-aggregation round driven stage by stage, so a test can tamper with any message in between."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable

import numpy as np
import pytest

from flayer.secagg import (
    KeyAdvert,
    KeyBundle,
    MaskedInput,
    RingSpec,
    SecAggClient,
    SecAggParams,
    SecAggServer,
    SeededEntropy,
    ShareBatch,
    UnmaskShares,
)


def device_ids(count: int) -> list[str]:
    return [f"dev-{i:02d}" for i in range(count)]


class StagedRound:
    """Clients and server of one round; each stage method runs it for ``devices`` (default: all)."""

    def __init__(self, count: int = 5, degree: int | None = None, threshold: int | None = None,
                 length: int = 16, round_id: int = 1, session: str = "fed-test", seed: bytes = b"seed",
                 graph_seed: bytes = bytes(32), bits: int = 32) -> None:
        ids = device_ids(count)
        k = count - 1 if degree is None else degree
        t = (k + 1) // 2 + 1 if threshold is None else threshold
        self.params = SecAggParams(session, round_id, tuple(ids), t, k, graph_seed, length,
                                   RingSpec.for_summands(1.0, count, bits))
        self.seed = seed
        self.clients = {d: self.client(d) for d in ids}
        self.server = SecAggServer(self.params)
        rng = np.random.default_rng(int.from_bytes(hashlib.sha256(seed).digest()[:4], "little"))
        self.vectors = {d: rng.integers(0, 2**bits, length, dtype=np.uint32) for d in ids}
        self.adverts: dict[str, KeyAdvert] = {}
        self.bundles: dict[str, KeyBundle] = {}
        self.routed: dict[str, ShareBatch] = {}
        self.masked: dict[str, MaskedInput] = {}
        self.batches: dict[str, ShareBatch] = {}
        self.unmasks: dict[str, UnmaskShares] = {}

    def client(self, device: str) -> SecAggClient:
        return SecAggClient(self.params, device, SeededEntropy(hashlib.sha256(self.seed + device.encode()).digest()))

    def fresh(self, device: str, stage: int) -> SecAggClient:
        """A new client for ``device`` replayed to ``stage`` (1 advertised, 2 shared, 3 masked): the same seed gives
        the same keys and shares, so the server's state still fits it (a refusing client answers no more)."""
        c = self.client(device)
        c.advertise()
        if stage >= 2:
            c.share_keys(self.bundles[device])
        if stage >= 3:
            c.masked_input(self.routed[device], self.vectors[device])
        self.clients[device] = c
        return c

    @property
    def ids(self) -> list[str]:
        return list(self.params.participants)

    def advertise(self, devices: Iterable[str] | None = None) -> None:
        for d in self.ids if devices is None else devices:
            self.adverts[d] = self.clients[d].advertise()
            self.server.receive_advert(self.adverts[d])

    def share(self, devices: Iterable[str] | None = None) -> None:
        for d in self.server.advertised if devices is None else devices:
            self.bundles[d] = self.server.key_bundle(d)
            self.batches[d] = self.clients[d].share_keys(self.bundles[d])
            self.server.receive_shares(self.batches[d])

    def mask(self, devices: Iterable[str] | None = None) -> None:
        for d in self.server.shared if devices is None else devices:
            self.routed[d] = self.server.shares_for(d)
            self.masked[d] = self.clients[d].masked_input(self.routed[d], self.vectors[d])
            self.server.receive_masked(self.masked[d])

    def unmask(self, devices: Iterable[str] | None = None) -> None:
        for d in self.server.survivors if devices is None else devices:
            self.unmasks[d] = self.clients[d].unmask(self.server.unmask_request(d))
            self.server.receive_unmask(self.unmasks[d])

    def plain_sum(self, devices: Iterable[str]) -> np.ndarray:
        total = np.zeros(self.params.length, dtype=np.uint32)
        for d in devices:
            total += self.vectors[d]
        return total


@pytest.fixture
def staged() -> Callable[..., StagedRound]:
    return StagedRound
