"""End-to-end tests: the CLI and the deployments as a user runs them."""
