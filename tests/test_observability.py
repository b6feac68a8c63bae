"""Operating a run: the Prometheus endpoint (scraped by a real Prometheus server), /health on a
stalled run, and the W&B and MLflow trackers read back by their own tools."""

from __future__ import annotations

import glob
import json
import shutil
import socket
import struct
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from postrl.config.observability import PrometheusConfig
from postrl.config.run import RunConfig
from postrl.run.metrics import read_metrics
from postrl.run.prometheus import PrometheusExporter
from postrl.run.trackers import GuardedSink
from postrl.types import StepMetrics

PHASES = {"generate", "reward", "train", "sync", "step"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def small_run(tmp_path: Path, name: str, **logging) -> RunConfig:
    return RunConfig.model_validate(
        {
            "name": name,
            "output_dir": str(tmp_path / "runs"),
            "steps": 5,
            "prompts_per_step": 8,
            "rollout": {"n": 4, "max_tokens": 12},
            "train": {"mini_batch_size": 32, "micro_batch_size": 32, "lr": 1e-4},
            "checkpoint": {"every_steps": 0},
            "logging": {"progress_bar": False, "samples_first_steps": 0, "samples_every": 0, **logging},
        }
    )


def scalars(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "run"))
            out[(sample.name, labels)] = sample.value
    return out


def test_exporter_series_follow_the_steps(tmp_path):
    exporter = PrometheusExporter(PrometheusConfig(port=0), 60.0, "r", echo=lambda _: None)
    try:
        for step, failures in ((1, 2.0), (2, 3.0)):
            values = {
                "time/generate_s": 0.5, "time/train_s": 2.0, "reward/mean": 0.25 * step, "reward/samples": 8.0,
                "reward/unscorable": 1.0, "sync/failures": failures, "memory/train_peak_mb": 100.0,
                "buffer/lag_max": 1.0, "actor/kl": float("nan"),
            }  # fmt: skip
            exporter.write(StepMetrics(step=step, weight_version=step, values=values))
        status, text = get(f"http://127.0.0.1:{exporter.port}/metrics")
    finally:
        exporter.close()
    got = scalars(text)
    assert status == 200
    assert got[("postrl_step_phase_seconds_count", (("phase", "generate"),))] == 2
    assert got[("postrl_step_phase_seconds_sum", (("phase", "train"),))] == 4.0
    assert got[("postrl_reward_mean", ())] == 0.5
    assert got[("postrl_samples_total", ())] == 16 and got[("postrl_unscorable_samples_total", ())] == 2
    assert got[("postrl_weight_sync_failures_total", ())] == 3  # a running total in the steps: not added twice
    assert got[("postrl_peak_memory_bytes", (("role", "train"),))] == 100 * 2**20
    assert got[("postrl_sample_lag", (("stat", "max"),))] == 1.0
    assert got[("postrl_step", ())] == 2 and got[("postrl_weight_version", ())] == 2
    assert ("postrl_kl", ()) not in got  # a NaN is not a reading
    assert got[("postrl_step_metric", (("name", "reward/mean"),))] == 0.5


def test_health_answers_503_when_no_step_finishes_in_time():
    now = [1000.0]
    exporter = PrometheusExporter(PrometheusConfig(port=0), 30.0, "r", echo=lambda _: None, clock=lambda: now[0])
    url = f"http://127.0.0.1:{exporter.port}/health"
    try:
        assert get(url)[0] == 200
        now[0] += 31  # the first step has not finished 31 s after the start
        status, body = get(url)
        assert status == 503 and json.loads(body)["status"] == "stalled"
        exporter.write(StepMetrics(step=1, weight_version=1, values={}))
        assert get(url)[0] == 200
        now[0] += 29
        assert get(url)[0] == 200
        now[0] += 2
        assert get(url)[0] == 503
        assert get(f"http://127.0.0.1:{exporter.port}/nope")[0] == 404
    finally:
        exporter.close()


@pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="needs Debian's prometheus (scripts/setup.sh installs it as root)"
)
@pytest.mark.slow
def test_a_real_prometheus_scrapes_every_phase_of_a_5_step_run(tmp_path, monkeypatch):
    from postrl.run.train_runner import train

    port, api = free_port(), free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs: [{{job_name: postrl, static_configs: [{{targets: ['127.0.0.1:{port}']}}]}}]\n"
    )
    server = subprocess.Popen(
        ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{api}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    query = f"http://127.0.0.1:{api}/api/v1/query?query="

    def scraped(expr: str) -> list[dict]:
        status, body = get(query + urllib.request.quote(expr))
        return json.loads(body)["data"]["result"] if status == 200 else []

    real_close = PrometheusExporter.close

    def close_once_scraped(exporter: PrometheusExporter) -> None:  # the endpoint lives as long as the run
        deadline = time.monotonic() + 60
        done = "count(postrl_step_phase_seconds_count == 5) >= 5 and on() postrl_samples_total == 160"
        while not scraped(done) and time.monotonic() < deadline:  # the last step's scrape, whole
            time.sleep(0.5)
        real_close(exporter)

    monkeypatch.setattr(PrometheusExporter, "close", close_once_scraped)
    try:
        config = small_run(tmp_path, "prom", prometheus={"port": port}, trackers=["jsonl"])
        train(config)
        counts = {r["metric"]["phase"]: float(r["value"][1]) for r in scraped("postrl_step_phase_seconds_count")}
        assert PHASES <= counts.keys(), counts
        assert all(counts[p] == 5 for p in PHASES), counts
        assert scraped("postrl_last_step_timestamp_seconds")
        assert float(scraped("postrl_samples_total")[0]["value"][1]) == 5 * 8 * 4
        assert float(scraped("postrl_engine_healthy")[0]["value"][1]) == 1
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.slow
def test_mlflow_reads_back_every_step_and_the_artifacts(tmp_path):
    from mlflow.tracking import MlflowClient

    from postrl.run.train_runner import train

    config = small_run(tmp_path, "mlf", trackers=["jsonl", "mlflow"])
    train(config)
    run_dir = tmp_path / "runs" / "mlf"
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir.resolve() / 'mlflow' / 'mlflow.db'}")
    run_id = (run_dir / "mlflow_run_id").read_text()
    history = client.get_metric_history(run_id, "reward/mean")
    expected = [(row["step"], row["reward/mean"]) for row in read_metrics(run_dir / "metrics.jsonl")]
    assert [(m.step, m.value) for m in history] == expected and len(expected) == 5
    run = client.get_run(run_id)
    assert run.data.params["train.lr"] == "0.0001" and run.data.params["rollout.n"] == "4"
    assert run.info.status == "FINISHED"
    top = {f.path for f in client.list_artifacts(run_id)}
    assert top == {"final_model", "plots"}
    assert "final_model/config.json" in {f.path for f in client.list_artifacts(run_id, "final_model")}


def wandb_history(run_dir: Path) -> list[dict]:
    """The history rows of an offline W&B run, read from its .wandb file (LevelDB-style log records
    of wandb's own protobuf Records)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    data, pos, block, pending, rows = Path(path).read_bytes(), 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or its last part
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


@pytest.mark.slow
def test_wandb_offline_run_directory_holds_the_scalars(tmp_path, monkeypatch):
    from postrl.run.train_runner import train

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    train(small_run(tmp_path, "wb", trackers=["jsonl", "wandb"]))
    run_dir = tmp_path / "runs" / "wb"
    rows = wandb_history(run_dir)
    expected = read_metrics(run_dir / "metrics.jsonl")
    assert [(r["step"], r["reward/mean"]) for r in rows] == [(e["step"], e["reward/mean"]) for e in expected]
    assert rows[0]["actor/grad_norm"] == expected[0]["actor/grad_norm"]


@pytest.mark.slow
def test_a_tracker_that_fails_mid_run_warns_once_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from postrl.run.train_runner import train

    real = MlflowClient.log_batch

    def server_gone_after_step_2(self, run_id, metrics=(), **kw):
        if any(m.step > 2 for m in metrics):
            raise MlflowException("API request to http://mlflow:5000 failed: connection refused")
        return real(self, run_id, metrics=metrics, **kw)

    monkeypatch.setattr(MlflowClient, "log_batch", server_gone_after_step_2)
    train(small_run(tmp_path, "gone", trackers=["jsonl", "mlflow"]))
    err = capsys.readouterr().err
    assert err.count("the mlflow tracker failed") == 1 and "at step 3" in err
    assert [row["step"] for row in read_metrics(tmp_path / "runs" / "gone" / "metrics.jsonl")] == [1, 2, 3, 4, 5]


def test_guarded_sink_drops_a_failing_tracker():
    class Broken:
        def __init__(self):
            self.calls = 0

        def write(self, metrics):
            self.calls += 1
            raise ConnectionError("server gone")

        def close(self):
            raise AssertionError("not called once dropped")

    said, inner = [], Broken()
    sink = GuardedSink(inner, "wandb", said.append)
    for step in (1, 2, 3):
        sink.write(StepMetrics(step=step, weight_version=step, values={}))
    sink.close()
    assert inner.calls == 1 and len(said) == 1 and "ConnectionError: server gone" in said[0]


def test_a_missing_tracker_package_is_a_validation_error_naming_the_extra(monkeypatch):
    import importlib.util

    from postrl.config.run import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    from postrl.config.loading import load_config

    with pytest.raises(
        ConfigError, match=r"logging.trackers: wandb needs the wandb package: pip install 'postrl\[wandb\]'"
    ):
        load_config("examples/arithmetic_grpo.yaml", ["logging.trackers=[jsonl,wandb]"])


def test_a_tracker_listed_twice_is_refused():
    with pytest.raises(ValueError, match="lists a tracker twice"):
        RunConfig.model_validate({"logging": {"trackers": ["jsonl", "jsonl"]}})


def test_exporter_port_in_use_is_a_clear_error():
    from postrl.config.run import ConfigError

    exporter = PrometheusExporter(PrometheusConfig(port=0), 60.0, "a", echo=lambda _: None)
    try:
        with pytest.raises(ConfigError, match=rf"cannot listen on 127.0.0.1:{exporter.port} .*logging.prometheus.port"):
            PrometheusExporter(PrometheusConfig(port=exporter.port), 60.0, "b", echo=lambda _: None)
    finally:
        exporter.close()


DOCS = Path(__file__).resolve().parent.parent / "docs"


def exposed_names() -> set[str]:
    """The series the exporter registers, as Prometheus names them (histograms and counters by family)."""
    exporter = PrometheusExporter(PrometheusConfig(port=0), 60.0, "r", echo=lambda _: None)
    try:
        names = set()
        for family in exporter.registry.collect():
            names.add(family.name + ("_total" if family.type == "counter" else ""))
        return names
    finally:
        exporter.close()


def test_the_documented_schema_is_what_the_endpoint_serves():
    table = [line for line in (DOCS / "observability.md").read_text().splitlines() if line.startswith("| `postrl_")]
    documented = {line.split("`")[1] for line in table}
    assert documented == exposed_names()


def test_the_alert_rules_and_the_dashboard_use_served_series():
    import re

    served = exposed_names() | {"postrl_step_phase_seconds_bucket", "postrl_step_phase_seconds_sum",
                                "postrl_step_phase_seconds_count"}  # fmt: skip
    rules = (DOCS / "prometheus_alerts.yml").read_text()
    dashboard = json.loads((DOCS / "grafana_dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = set(re.findall(r"postrl_[a-z_]+", rules + " ".join(exprs)))
    assert used and used <= served, used - served
    for alert in ("PostrlRunStalled", "PostrlWeightSyncFailures", "PostrlUnscorableRate", "PostrlEngineRestarts"):
        assert f"alert: {alert}" in rules
    if shutil.which("promtool"):
        checked = subprocess.run(
            ["promtool", "check", "rules", str(DOCS / "prometheus_alerts.yml")], capture_output=True, text=True
        )
        assert checked.returncode == 0 and "SUCCESS: 5 rules found" in checked.stdout, checked.stdout + checked.stderr


def documented_metric_names(text: str) -> set[str]:
    import re

    groups = "actor|critic|reward|response|perf|rollout|buffer|data|time|sync|val|sft|dpo|kl"
    return set(re.findall(rf"`((?:{groups})/[a-z_0-9/]*[a-z_0-9])`", text))  # a folder ends with /


def unknown_metric_names(documented: set[str]) -> set[str]:
    """Documented names the code does not write: not a constant of :mod:`postrl.types.metric_names`,
    nor one of the names it builds (a component's mean, a stage's seconds, validation's episodes)."""
    import re

    from postrl.types import metric_names

    known = {v for k, v in vars(metric_names).items() if k.isupper() and isinstance(v, str)}
    built = re.compile(rf"(reward|val)/\w+/mean|time/\w+_s|{metric_names.VAL_AGENT}/\w+")
    return {n for n in documented if n not in known and not built.fullmatch(n)}


def test_every_metric_the_docs_name_is_one_the_code_writes():
    text = "".join(p.read_text() for p in [*DOCS.glob("*.md"), DOCS.parent / "README.md"])
    documented = documented_metric_names(text)
    assert len(documented) >= 30 and not unknown_metric_names(documented), unknown_metric_names(documented)
    assert unknown_metric_names({"actor/kl_divergence", "actor/kl", "time/wait_s"}) == {"actor/kl_divergence"}
