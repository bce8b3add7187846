"""The broker's rules: run configuration, packing, off-policy statistics, the Redis store."""
