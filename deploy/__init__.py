"""Deployment artefacts; deploy.local runs a local Apache Kafka for development and tests."""
