"""Startup refusals: each bad configuration stops with one line naming what to change; the
`alpamayo-worker` entry point turns that into one stderr line and exit code 2."""

import os
import re
import subprocess
import sys

import pytest

from worker.config import VARIABLES, ConfigError, load_settings

from tests import REPO_ROOT


def refused(env, *must_contain):
    with pytest.raises(ConfigError) as info:
        load_settings(env)
    msg = str(info.value)
    assert "\n" not in msg and msg.strip() == msg and msg
    for part in must_contain:
        assert part in msg, msg
    return msg


def test_profile_and_precision_together():
    refused({"NIM_MODEL_PROFILE": "bf16-dflash2", "NIM_PRECISION": "bf16"}, "NIM_MODEL_PROFILE", "NIM_PRECISION",
            "unset NIM_PRECISION")


def test_custom_head_with_ft_checkpoint_cannot_be_combined(tmp_path):
    refused({"NIM_MODEL_PROFILE": "bf16-dflash2", "NIM_ALPAMAYO_SPECULATIVE_MODEL": str(tmp_path / "h"),
             "NIM_FT_CHECKPOINT": str(tmp_path / "c")},
            "NIM_ALPAMAYO_SPECULATIVE_MODEL", "NIM_FT_CHECKPOINT", "cannot be combined")


@pytest.mark.parametrize("env", [{"NIM_MODEL_PROFILE": "bf16"}, {"NIM_MODEL_PROFILE": "fp8"},
                                 {"NIM_PRECISION": "fp8"}, {}])
def test_custom_head_with_a_baseline_profile(env, tmp_path):
    refused({**env, "NIM_ALPAMAYO_SPECULATIVE_MODEL": str(tmp_path)}, "bf16-dflash2", "fp8-dflash2",
            "NIM_PRECISION", "baseline")


@pytest.mark.parametrize("raw", ["1,x", "0", "17", "1,,2", "-1", "1.5", "two"])
def test_bad_k_list(raw):
    refused({"NIM_ALPAMAYO_TRAJ_SAMPLES": raw}, "NIM_ALPAMAYO_TRAJ_SAMPLES", "1..16")


@pytest.mark.parametrize("name,value", [
    ("NIM_MODEL_PROFILE", "fp16"), ("NIM_PRECISION", "fp16-dflash2"), ("NIM_ALPAMAYO_SPEC_METRICS", "full"),
    ("ALPAMAYO_PROCESSING_GUARANTEE", "exactly-once"), ("ALPAMAYO_KAFKA_SECURITY_PROTOCOL", "TLS"),
    ("ALPAMAYO_KAFKA_SASL_MECHANISM", "GSSAPI"), ("ALPAMAYO_DEVICE", "tpu"), ("ALPAMAYO_LOG_LEVEL", "LOUD"),
    ("ALPAMAYO_RESULT_FORMAT", "xml"),
])
def test_bad_choices_name_the_variable_and_the_choices(name, value):
    msg = refused({name: value}, name, value)
    assert "use one of" in msg


def test_result_format_picks_the_content_type_of_every_output():
    assert load_settings({}).result_content_type == "application/msgpack"
    assert load_settings({"ALPAMAYO_RESULT_FORMAT": "json"}).result_content_type == "application/json"


def test_sasl_without_credentials():
    refused({"ALPAMAYO_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"}, "ALPAMAYO_KAFKA_SASL_USERNAME",
            "ALPAMAYO_KAFKA_SASL_PASSWORD")
    refused({"ALPAMAYO_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "ALPAMAYO_KAFKA_SASL_USERNAME": "u"},
            "ALPAMAYO_KAFKA_SASL_PASSWORD")


def test_missing_ca_file(tmp_path):
    refused({"ALPAMAYO_KAFKA_SSL_CAFILE": str(tmp_path / "ca.pem")}, "ALPAMAYO_KAFKA_SSL_CAFILE", "does not exist")


@pytest.mark.parametrize("name,value", [
    ("ALPAMAYO_MAX_BATCH_SIZE", "0"), ("ALPAMAYO_MAX_BATCH_SIZE", "many"), ("ALPAMAYO_HTTP_PORT", "70000"),
    ("ALPAMAYO_MAX_INFLIGHT", "0"), ("ALPAMAYO_MAX_BATCH_WAIT_MS", "-1"), ("NIM_ALPAMAYO_MAX_MODEL_LEN", "8"),
    ("ALPAMAYO_MAX_REASONING_TOKENS", "0"), ("ALPAMAYO_MAX_REASONING_TOKENS", "300"),
    ("ALPAMAYO_MAX_REQUEST_BYTES", "10"),
])
def test_bad_numbers(name, value):
    refused({name: value}, name)


def test_bad_drain_timeout_topic_and_claim_check_root():
    refused({"ALPAMAYO_DRAIN_TIMEOUT_S": "soon"}, "ALPAMAYO_DRAIN_TIMEOUT_S")
    refused({"ALPAMAYO_RESULT_TOPIC": "results topic"}, "ALPAMAYO_RESULT_TOPIC", "topic name")
    refused({"ALPAMAYO_CLAIM_CHECK_ROOTS": "/data,relative/dir"}, "ALPAMAYO_CLAIM_CHECK_ROOTS", "relative/dir")


def test_defaults_and_profiles():
    s = load_settings({})
    assert (s.profile, s.k_values, s.spec_metrics, s.processing_guarantee) == ("bf16", (1,), "none", "at_least_once")
    assert s.max_reasoning_tokens is None and not s.speculative
    s = load_settings({"NIM_MODEL_PROFILE": "fp8-dflash2", "NIM_ALPAMAYO_TRAJ_SAMPLES": "3,1,2,2"})
    assert (s.precision, s.speculative, s.spec_metrics, s.k_values) == ("fp8", True, "summary", (1, 2, 3))
    s = load_settings({"NIM_PRECISION": "fp8", "NIM_ALPAMAYO_SPEC_METRICS": "detailed"})
    assert (s.profile, s.spec_metrics) == ("fp8", "none")          # baseline: never spec metrics
    s = load_settings({"ALPAMAYO_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "ALPAMAYO_KAFKA_SASL_USERNAME": "u",
                       "ALPAMAYO_KAFKA_SASL_PASSWORD": "p", "ALPAMAYO_GROUP_INSTANCE_ID": "pod-1",
                       "ALPAMAYO_MAX_REASONING_TOKENS": "12"})
    assert (s.sasl_mechanism, s.worker_id, s.group_instance_id, s.max_reasoning_tokens) == (
        "SCRAM-SHA-512", "pod-1", "pod-1", 12)
    assert "sasl_password" not in repr(s)                           # the password never lands in logs


def test_every_variable_read_is_documented():
    src = (REPO_ROOT / "worker" / "config.py").read_text()
    read = set(re.findall(r'"((?:NIM|ALPAMAYO)_[A-Z0-9_]+)"', src.split("VARIABLES: dict")[0]))
    assert read - set(VARIABLES) == set(), "variables read but not in VARIABLES"
    assert set(VARIABLES) - read == set(), "documented but never read"


def _cli(args, env_extra, timeout=120):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NIM_", "ALPAMAYO_KAFKA", "ALPAMAYO_PROC"))}
    env["PYTHONPATH"] = str(REPO_ROOT)
    env.update(env_extra)
    return subprocess.run([sys.executable, "-m", "worker", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO_ROOT)


@pytest.mark.parametrize("env,needle", [
    ({"NIM_MODEL_PROFILE": "bf16-dflash2", "NIM_PRECISION": "fp8"}, "unset NIM_PRECISION"),
    ({"NIM_ALPAMAYO_SPECULATIVE_MODEL": "/heads/h", "NIM_FT_CHECKPOINT": "/ckpt", "NIM_MODEL_PROFILE": "bf16-dflash2"},
     "cannot be combined"),
    ({"NIM_ALPAMAYO_TRAJ_SAMPLES": "1,99"}, "NIM_ALPAMAYO_TRAJ_SAMPLES"),
    ({"ALPAMAYO_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"}, "ALPAMAYO_KAFKA_SASL_USERNAME"),
])
def test_serve_with_bad_config_exits_2_with_one_line(env, needle):
    p = _cli(["serve"], env, timeout=60)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], p.stderr
    assert p.stdout == ""


def test_help_does_not_import_torch():
    code = ("import sys, contextlib, io\nfrom worker.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try: main(['--help'])\n    except SystemExit: pass\n"
            "print('torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                       capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert p.stdout.strip() == "False", p.stderr


def test_check_head_cli(tiny, tmp_path):
    ckpt, head = tiny
    ok = _cli(["check-head", str(head)], {"NIM_FT_CHECKPOINT": str(ckpt)})
    assert ok.returncode == 0 and ok.stdout.startswith("ok: "), ok.stdout + ok.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    bad = _cli(["check-head", str(empty)], {"NIM_FT_CHECKPOINT": str(ckpt)})
    assert bad.returncode == 1
    assert bad.stdout.strip().splitlines() == [f"NIM_ALPAMAYO_SPECULATIVE_MODEL={empty} is empty: copy the complete "
                                               "exported head directory"]


def test_serve_refuses_a_bad_checkpoint_before_ready(tmp_path, kafka_bootstrap):
    """A checkpoint that fails its checks is a startup refusal: exit 2 with one line naming it
    (Kafka reachable: an unreachable broker is refused first, before any model work)."""
    empty = tmp_path / "ckpt"
    empty.mkdir()
    p = _cli(["serve"], {"NIM_FT_CHECKPOINT": str(empty), "ALPAMAYO_DEVICE": "cpu", "ALPAMAYO_HTTP_PORT": "0",
                         "ALPAMAYO_HTTP_HOST": "127.0.0.1", "ALPAMAYO_LOG_LEVEL": "ERROR",
                         "ALPAMAYO_KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap})
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and str(empty) in lines[0], p.stderr


def test_run_scene_cli_runs_one_scene_end_to_end(tiny, tmp_path):
    from worker.scenes import generate_scene, write_scene

    ckpt, _ = tiny
    path = write_scene(generate_scene(3), tmp_path / "scene.msgpack")
    p = _cli(["run-scene", str(path), "--k", "2"], {"NIM_FT_CHECKPOINT": str(ckpt), "ALPAMAYO_DEVICE": "cpu",
                                                   "ALPAMAYO_MAX_REASONING_TOKENS": "4",
                                                   "ALPAMAYO_LOG_LEVEL": "WARNING"})
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert "task trajectory, K=2" in out and "sample 1 (4 tokens)" in out
    assert "trajectory 0: 64 points" in out and "trajectory 1: 64 points" in out and "timings ms:" in out
    q = _cli(["run-scene", str(path), "--task", "vqa", "--max-tokens", "3"],
             {"NIM_FT_CHECKPOINT": str(ckpt), "ALPAMAYO_DEVICE": "cpu", "ALPAMAYO_LOG_LEVEL": "WARNING",
              "ALPAMAYO_MAX_REASONING_TOKENS": "4"})
    assert q.returncode == 0 and "answer:" in q.stdout and "trajectory 0" not in q.stdout, q.stdout + q.stderr


def test_run_scene_refuses_a_bad_checkpoint_in_one_line(tiny, tmp_path):
    """A startup refusal from loading (here no weight shard; on a GPU a memory fraction too small
    for one scene) ends run-scene with one line and exit code 2, not a traceback."""
    import shutil

    from worker.scenes import generate_scene, write_scene

    ckpt = shutil.copytree(tiny[0], tmp_path / "ckpt")
    for shard in ckpt.glob("*.safetensors"):
        shard.unlink()
    path = write_scene(generate_scene(3), tmp_path / "scene.msgpack")
    p = _cli(["run-scene", str(path)], {"NIM_FT_CHECKPOINT": str(ckpt), "ALPAMAYO_DEVICE": "cpu",
                                        "ALPAMAYO_LOG_LEVEL": "WARNING"})
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("alpamayo-worker: ") and str(ckpt) in lines[0], p.stderr


@pytest.mark.parametrize("value", ["0", "1.5", "-0.1", "ninety", "nan"])
def test_bad_gpu_memory_fraction(value):
    refused({"ALPAMAYO_GPU_MEMORY_FRACTION": value}, "ALPAMAYO_GPU_MEMORY_FRACTION", "(0, 1]")


def test_gpu_memory_fraction_default_and_value():
    assert load_settings({}).gpu_memory_fraction == 0.90
    assert load_settings({"ALPAMAYO_GPU_MEMORY_FRACTION": "0.5"}).gpu_memory_fraction == 0.5


@pytest.mark.parametrize("name", ["NIM_FT_CHECKPOINT", "NIM_ALPAMAYO_SPECULATIVE_MODEL"])
def test_missing_directories_name_their_variable(name, tmp_path):
    refused({name: str(tmp_path / "nope"), "NIM_MODEL_PROFILE": "bf16-dflash2"}, f"{name}={tmp_path / 'nope'}",
            "is not a directory")


@pytest.mark.parametrize("env,needle", [
    ({"ALPAMAYO_REVIEW_TOPIC": "rev", "ALPAMAYO_REVIEW_THRESHOLD": "1.5"}, "ALPAMAYO_REVIEW_THRESHOLD='1.5'"),
    ({"ALPAMAYO_REVIEW_TOPIC": "rev", "ALPAMAYO_REVIEW_THRESHOLD": "high"}, "ALPAMAYO_REVIEW_THRESHOLD='high'"),
    ({"ALPAMAYO_REVIEW_THRESHOLD": "0.5"}, "ALPAMAYO_REVIEW_TOPIC is not"),
    ({"ALPAMAYO_REVIEW_TOPIC": "review topic"}, "ALPAMAYO_REVIEW_TOPIC='review topic'"),
])
def test_bad_review_settings(env, needle):
    refused(env, needle)


def test_review_topic_default_and_value():
    s = load_settings({})
    assert (s.review_topic, s.review_threshold) == (None, 0.5)
    s = load_settings({"ALPAMAYO_REVIEW_TOPIC": "alpamayo.review", "ALPAMAYO_REVIEW_THRESHOLD": "0.8"})
    assert (s.review_topic, s.review_threshold) == ("alpamayo.review", 0.8)
