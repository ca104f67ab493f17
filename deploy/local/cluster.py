"""The command line of the local Apache Kafka, and the names its importers use.

A real Apache Kafka (KRaft) on loopback, from Maven Central jars, for development and tests;
stdlib only, because the Makefile runs it with the system python (no venv). The modules:

- :mod:`deploy.local.jars`: the cache directory, the Kafka jars (Maven) and the Java to run them;
- :mod:`deploy.local.probe`: a minimal Kafka wire-protocol client, the readiness probe;
- :mod:`deploy.local.node_config`: server.properties, log4j2 settings and TLS material of a node;
- :mod:`deploy.local.host`: free ports, live pids and log tails;
- :mod:`deploy.local.local_kafka`: :class:`LocalKafka`, a named cluster of 1..N nodes.

Python use::

    from deploy.local.cluster import LocalKafka
    kafka = LocalKafka(name="dev", nodes=1)
    bootstrap = kafka.start()      # idempotent; returns "127.0.0.1:PORT[,...]"
    kafka.kill_node(2); kafka.start_node(2)   # node ids are 1..nodes (= Kafka broker ids)
    kafka.stop()

CLI::

    python -m deploy.local.cluster start|stop|status|kill-node I|start-node I|stop-node I|jars \
        [--name N] [--nodes N] [--security plaintext|sasl_ssl] [--base-port P] [--fresh]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from deploy.local.errors import LocalKafkaError
from deploy.local.jars import ensure_jars
from deploy.local.local_kafka import LocalKafka
from deploy.local.node_config import SCRAM_MECHANISM, SECURITY_MODES

__all__ = ["LocalKafka", "LocalKafkaError", "main"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deploy.local.cluster",
                                 description="Run a local Apache Kafka (KRaft) from Maven Central jars.")
    ap.add_argument("command", choices=["start", "stop", "status", "kill-node", "start-node", "stop-node", "jars"])
    ap.add_argument("node", nargs="?", type=int, help="node id (1..nodes) for kill-node/start-node/stop-node")
    ap.add_argument("--name", default=os.environ.get("ALPAMAYO_KAFKA_NAME", "dev"))
    ap.add_argument("--nodes", type=int, default=None, help="default: as last started, else 1")
    ap.add_argument("--security", choices=SECURITY_MODES, default=None, help="default: as last started, else plaintext")
    ap.add_argument("--base-port", type=int, default=None)
    ap.add_argument("--fresh", action="store_true", help="start: wipe data first (when not running)")
    ap.add_argument("--timeout", type=float, default=None)
    ap.add_argument("--json", action="store_true", help="status: print JSON")
    args = ap.parse_args(argv)

    try:
        if args.command == "jars":
            print(ensure_jars(quiet=False))
            return 0
        kafka = LocalKafka.from_state(args.name, nodes=args.nodes, security=args.security, base_port=args.base_port)
        if args.command == "start":
            t0 = time.monotonic()
            bootstrap = kafka.start(fresh=args.fresh, timeout=args.timeout)
            print(bootstrap)
            print(f"# local Kafka {kafka.name!r}: {kafka.nodes} node(s), {kafka.security}, ready in "
                  f"{time.monotonic() - t0:.1f}s; state {kafka.state_dir}", file=sys.stderr)
            if kafka.security == "sasl_ssl":
                print(f"# SCRAM users {sorted(kafka.users)} (mechanism {SCRAM_MECHANISM}); CA {kafka.ca_file}",
                      file=sys.stderr)
            return 0
        if args.command == "stop":
            kafka.stop(timeout=args.timeout or 30.0)
            print(f"stopped local Kafka {kafka.name!r}")
            return 0
        if args.command == "status":
            st = kafka.status()
            if args.json:
                print(json.dumps(st, indent=2))
            else:
                print(f"{st['name']}: {'running' if st['running'] else 'not running'}"
                      f" ({st['nodes']} node(s), {st['security']}, Kafka {st['kafka_version']})")
                if st.get("bootstrap"):
                    print(f"bootstrap: {st['bootstrap']}")
                for i, ns in st["nodes_status"].items():
                    print(f"  node {i}: pid={ns['pid']} alive={ns['alive']} probe={ns['probe']} log={ns['log']}")
                if st.get("ca_file"):
                    print(f"ca_file: {st['ca_file']}  users: {', '.join(st['users'])}")
            return 0 if st["running"] else 3
        if args.node is None:
            ap.error(f"{args.command} needs a node id")
        if args.command == "kill-node":
            kafka.kill_node(args.node)
        elif args.command == "stop-node":
            kafka.stop_node(args.node)
        else:
            kafka.start_node(args.node, timeout=args.timeout)
        print(f"{args.command} {args.node}: done")
        return 0
    except LocalKafkaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # e.g. `status | head -1`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
