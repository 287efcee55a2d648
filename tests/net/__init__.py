"""Networked tests: real peers as separate OS processes on 127.0.0.1 (see harness.py)."""
