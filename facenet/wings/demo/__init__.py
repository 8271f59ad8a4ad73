"""The demo's built-in data: synthetic identities rendered on the CPU, with their pairs."""
