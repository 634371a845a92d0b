"""Runnable examples: ``python -m ctxprefill_client.examples.orchestrator --help``."""
