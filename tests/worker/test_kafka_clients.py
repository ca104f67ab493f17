"""The Kafka client settings (worker.kafka_clients): one SASL/SSL builder for the worker and the
producer tools; static membership only when configured; one transactional id per input partition."""

from __future__ import annotations

import ssl
from dataclasses import replace

from producer_tools.common import client_kwargs, kafka_options
from worker.config import load_settings
from worker.kafka_clients import consumer_kwargs, producer_kwargs, security_kwargs, transactional_id

SASL_SSL = {"ALPAMAYO_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "ALPAMAYO_KAFKA_SASL_USERNAME": "alice",
            "ALPAMAYO_KAFKA_SASL_PASSWORD": "secret", "ALPAMAYO_KAFKA_BOOTSTRAP_SERVERS": "k1:9093,k2:9093"}


def test_plaintext_has_no_tls_nor_sasl():
    assert security_kwargs(load_settings({})) == {"security_protocol": "PLAINTEXT"}


def test_sasl_ssl_verifies_the_broker_and_defaults_to_scram_sha_512():
    kw = security_kwargs(load_settings(SASL_SSL))
    assert kw["security_protocol"] == "SASL_SSL" and kw["sasl_mechanism"] == "SCRAM-SHA-512"
    assert (kw["sasl_plain_username"], kw["sasl_plain_password"]) == ("alice", "secret")
    ctx = kw["ssl_context"]
    assert isinstance(ctx, ssl.SSLContext) and ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname


def test_the_tools_use_the_worker_builder():
    opts = kafka_options(SASL_SSL)
    kw = client_kwargs(opts)
    assert kw.pop("bootstrap_servers") == "k1:9093,k2:9093"
    assert kw.pop("ssl_context").verify_mode == ssl.CERT_REQUIRED
    ref = security_kwargs(opts)
    ref.pop("ssl_context")
    assert kw == ref
    # a protocol given on the command line without a mechanism gets the worker's default too
    sasl = client_kwargs(replace(kafka_options({}), security_protocol="SASL_PLAINTEXT", sasl_username="u",
                                 sasl_password="p"))
    assert sasl["sasl_mechanism"] == "SCRAM-SHA-512" and "ssl_context" not in sasl


def test_static_member_only_when_set_and_transactional_id_per_partition():
    s = load_settings({"ALPAMAYO_GROUP_ID": "g", "ALPAMAYO_GROUP_INSTANCE_ID": "pod-3",
                       "ALPAMAYO_PROCESSING_GUARANTEE": "exactly_once"})
    assert transactional_id("g", "req", 2) == "g.req.2"
    assert producer_kwargs(s, ("req", 2))["transactional_id"] == "g.req.2"
    c = consumer_kwargs(s, revoke_timeout_s=60.0)
    assert c["group_instance_id"] == "pod-3" and c["isolation_level"] == "read_committed"
    assert c["enable_auto_commit"] is False and c["rebalance_timeout_ms"] == 90_000
    assert "transactional_id" not in producer_kwargs(load_settings({}))


def test_default_configuration_is_not_a_static_member():
    """Two workers on one host (one per GPU) with the default configuration must not share a
    static member id (they would take each other's partitions): no id unless the operator sets one."""
    s = load_settings({"ALPAMAYO_PROCESSING_GUARANTEE": "exactly_once"})
    assert consumer_kwargs(s, revoke_timeout_s=60.0)["group_instance_id"] is None
    assert "transactional_id" not in producer_kwargs(s)
