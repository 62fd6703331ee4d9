"""Engines: the model-holding half of each role. Small Protocols, chosen by the backend string."""
