"""Checks that need several devices: run by tests/test_sharding.py in a process of its own."""
