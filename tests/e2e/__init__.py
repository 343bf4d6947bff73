"""End-to-end tests: a real symphony-kernel (or gateway) process, or the real model."""
