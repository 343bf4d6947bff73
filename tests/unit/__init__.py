"""Unit tests, one folder per package: no kernel process, no real model; marked ``unit``."""
