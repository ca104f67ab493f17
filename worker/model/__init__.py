"""Alpamayo 2 Super model runtime."""
