"""mqtt_broker package."""
