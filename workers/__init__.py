"""Background workers: thin loops that call into the broker, the accounting and access."""
