"""Quality evaluation: the eval harness and the small-model router benchmark."""
