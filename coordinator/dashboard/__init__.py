"""Watching a federation: the fleet view an observer folds (:mod:`.fleet`), its live feed from the broker
and the metrics file (:mod:`.watch`), and the read-only web server of ``flayer dashboard`` (:mod:`.server`)
with its page under ``static/`` (shipped as package data)."""
