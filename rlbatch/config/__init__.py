"""Configuration: the typed schema (``schema``) and its registration with Hydra (``register``)."""
