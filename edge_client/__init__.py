"""edge_client package."""
