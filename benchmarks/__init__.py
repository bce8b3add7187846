"""Benchmarks of Rollout Broker against raw Redis and a naive in-memory buffer."""
