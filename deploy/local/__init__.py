"""Local Apache Kafka (KRaft) from Maven Central jars: see cluster.py."""
