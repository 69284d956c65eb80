"""A whole fleet on one machine (or a few): the real broker, the real coordinator and many real edge
clients, with each device's speed, links, availability and crashes emulated.

The one package that imports both the coordinator and the edge client (a device installs neither it
nor the coordinator). What is real: every device is an :class:`edge_client.client.EdgeClient` with
its own MQTT connection, credentials, threads and state folder; the coordinator is
:class:`coordinator.server.Coordinator` in its own process; the broker is Mosquitto or the embedded
one; every byte crosses real sockets in the wire format. What is emulated, through the edge
client's hooks only: compute speed (:mod:`emulator.device`), link bandwidth and latency
(:mod:`emulator.shaping`), availability and crashes (:mod:`emulator.availability`).

Modules: :mod:`~emulator.profiles` (device profiles, the fleet mix), :mod:`~emulator.availability`,
:mod:`~emulator.shaping`, :mod:`~emulator.netloop` (one network thread for many clients),
:mod:`~emulator.device` and :mod:`~emulator.host` (devices in a worker process),
:mod:`~emulator.worker` and :mod:`~emulator.coordinator_proc` (the child processes),
:mod:`~emulator.options`, :mod:`~emulator.setup`, :mod:`~emulator.fleet`, :mod:`~emulator.launcher`
(``flayer emulate``), :mod:`~emulator.progress`, :mod:`~emulator.events`, :mod:`~emulator.report`.
"""
