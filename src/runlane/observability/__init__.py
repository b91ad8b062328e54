"""What runlane tells an operator while it runs: metrics, traces and logs."""
