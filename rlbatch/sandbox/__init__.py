"""Run code a policy wrote against hidden tests, contained, on the node's CPUs: see ``runner``."""
