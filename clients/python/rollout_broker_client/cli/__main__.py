"""``python -m rollout_broker_client.cli``: the same as ``rollout-broker-ctl``."""

from rollout_broker_client.cli import main

main()
