"""Security tests: the sandbox, hostile LIPs (lips/hostile/) and isolation between users."""
