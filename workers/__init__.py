"""Background workers: thin loops that call into the broker and the accounting."""
