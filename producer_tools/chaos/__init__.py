"""Reliability harness: crashes, broker faults, fuzzed input and soak against a real Kafka.

Every scenario runs the real pipeline - ``python -m worker serve`` subprocesses (a tiny random
checkpoint on CPU, reasoning capped at a few tokens), the producer tools' ``publish`` (run
manifest), ``sink`` (a ``python -m producer_tools sink`` subprocess writing the Parquet lake) and
``audit`` - injects its faults, waits until the pipeline has settled by itself (no manual step),
and prints one row of figures per run::

    python -m producer_tools.chaos crash --scenes 1000 --kills 10 --guarantee both
    python -m producer_tools.chaos broker-restart --scenes 300
    python -m producer_tools.chaos leader-kill --scenes 300
    python -m producer_tools.chaos fuzz --bad 10000 --good 200
    python -m producer_tools.chaos soak --minutes 30 --rate 2
    python -m producer_tools.chaos poison --scenes 40
    python -m producer_tools.chaos multi-sink --scenes 2000 --faults 30

Scenarios
---------
``crash``
    N scenes published up front; the worker is SIGKILLed ``--kills`` times at random moments
    (random progress points drawn one per equal slice of the run, plus a random delay) and
    restarted with the same static member id; optionally the sink is SIGKILLed too
    (``--sink-kills``). Settled = the worker group's committed offsets reached the request
    topic's end, the output topics are read to their end, and the lake holds every output record.
``broker-restart``
    a single-node local Kafka; mid-run the node is stopped (``--hard``: SIGKILLed), kept down
    ``--down-s`` seconds and started again.
``leader-kill``
    a 3-node KRaft cluster on loopback, topics with replication factor 3 and
    ``min.insync.replicas=2``; mid-run the leader of request partition 0 is SIGKILLed, the second
    half of the scenes is published while it is down, and it is restarted after ``--down-s``.
``fuzz``
    ``--bad`` generated bad messages (truncated msgpack, garbage, wrong types, out-of-range
    values, huge arrays, bad base64, bad JPEG/PNG, decompression bombs, NaN/inf egomotion, wrong
    image counts, unknown schema versions, oversize, claim-check escapes, ...) interleaved with
    ``--good`` valid scenes through one worker: the worker must stay up, every bad message must
    come back as a dead letter whose code is one its category allows, every good one as a
    result, and the worker's RSS (``/proc/PID/status``) must grow less than ``--max-rss-growth-mb``.
``multi-sink``
    no worker: result records published in transactions (one in eight aborted) while three sinks
    of one group are SIGKILLed, SIGTERMed and restarted ``--faults`` times at random, with small
    segments and a pause after each data file, so that kills land between a segment's files and
    the next owners replay crashed segments while being killed, stopped or revoked themselves.
    Passes when every committed record is in the lake exactly once and no aborted one is
    (``producer_tools.chaos.multi_sink``).
``soak``
    publishing at ``--rate`` scenes/s for ``--minutes``; the worker's (and sink's) RSS and the
    worker's ``alpamayo_gpu_memory_bytes`` are sampled; growth and slope are reported.
``poison``
    requests with 1.2 MB keys and headers, 12,000 headers, values at and just above the worker's
    request limit (``producer_tools.chaos.poison``): each must end as the one result or dead
    letter its kind allows, and the worker must stay up.

Figures (one row per run; ``--json`` prints them as JSON too)
-------------------------------------------------------------
``published`` request ids acknowledged (run manifest); ``results`` / ``dead letters`` rows in the
lake (fuzz: records on the topics); ``lost`` published ids with no row (``audit``'s missing);
``duplicated`` rows beyond the first per request id, *raw*, before any deduplication (at-least-once
re-deliveries; always 0 in exactly_once); ``after dedup`` the same once each table is read one row
per request id (``read_lake(..., dedupe=True)``; a request answered by a dead letter and later by
a result keeps both rows); ``lake dup`` a Kafka record present twice in the
lake (the sink's exactly-once: must be 0); ``kills`` faults injected (worker SIGKILLs + sink
SIGKILLs + broker stops); ``restarts`` processes started again (worker restarts, planned or after
an unplanned exit, sink and broker restarts); ``exits`` unplanned worker exits (a worker that gave
up by itself, restarted by the harness as a supervisor would).

The run passes (exit 0) when nothing is lost, no Kafka record is twice in the lake, exactly_once
shows no duplicate, every requested fault landed mid-run and the final SIGTERM drained the worker
(exit 0). Long runs are opt-in; the tests in ``tests/reliability/`` run short ones.

Modules: ``figures`` (one row per run), ``fuzz`` (the bad-message corpus), ``broker`` (the cluster,
topics, offsets), ``processes`` (the supervised worker and sink), ``monitor`` (the output topics as
a reader sees them), ``pipeline`` (one run end to end), ``scenarios``, ``multi_sink``, ``__main__`` (the command).
"""
