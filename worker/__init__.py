"""Alpamayo 2 Super Kafka inference worker."""
