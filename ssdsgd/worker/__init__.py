"""The worker's stage machine: warm-up, steps delay, pulls."""
