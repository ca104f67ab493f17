"""Local Apache Kafka (KRaft) from Maven Central jars, stdlib only: see cluster.py."""
