"""Helpers shared by test modules (no test module imports another)."""
