"""Rollout Broker: a REST broker between RL generators and trainers."""

__version__ = "0.1.0"
