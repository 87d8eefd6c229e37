"""The launch/ files: every script parses, the Kubernetes manifests are valid objects of their
kinds (kubernetes-validate, the `k8s` extra) and the servers' and the learner's agree with each
other, and launch/fleet_local.sh runs a fleet on this machine and stops it on SIGTERM."""
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import FAST, checkpoint_steps, lineage, wait_for_step

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "launch").glob("*.sh")) + sorted((ROOT / "launch").glob("*.sbatch"))
MANIFESTS = sorted((ROOT / "launch" / "k8s").glob("*.yaml"))
K8S_VERSION = "1.37.0"  # the newest API schemas kubernetes-validate 1.37.0 ships
CRDS = {"JobSet": "jobset.x-k8s.io/v1alpha2"}  # custom kinds: no schema offline, checked by hand below


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_there_are_launch_files():
    names = {p.name for p in SCRIPTS + MANIFESTS}
    assert {"local.sh", "tpu_pod.sh", "fleet_local.sh", "fleet_tpu_pod.sh", "slurm_gpu.sbatch",
            "gpu.yaml", "tpu.yaml", "tpu-jobset.yaml"} <= names, names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert script.read_text().startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in script.read_text()


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_manifest_is_valid(manifest):
    """Core kinds against the Kubernetes API schemas, strictly (an unknown field fails); a
    custom kind (JobSet) has no schema offline: its apiVersion is checked, and its jobs' pod
    templates as Jobs of their own."""
    kv = pytest.importorskip("kubernetes_validate")
    for d in docs(manifest):
        if d["kind"] in CRDS:
            assert d["apiVersion"] == CRDS[d["kind"]]
            for rj in d["spec"]["replicatedJobs"]:
                job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": rj["name"]}, "spec": rj["template"]["spec"]}
                kv.validate(job, K8S_VERSION, strict=True)
            continue
        kv.validate(d, K8S_VERSION, strict=True)


def _pods(manifest: Path) -> dict[str, dict]:
    """'server' and 'learner': the pod spec of each, from a Deployment and a Job or a JobSet."""
    out = {}
    for d in docs(manifest):
        if d["kind"] == "Deployment":
            out["server"] = d["spec"]["template"]
        elif d["kind"] == "Job":
            out["learner"] = d["spec"]["template"]
            out["learner_job"] = d["spec"]
        elif d["kind"] == "JobSet":
            for rj in d["spec"]["replicatedJobs"]:
                role = "learner" if rj["name"] == "learner" else "server"
                out[role] = rj["template"]["spec"]["template"]
                if role == "learner":
                    out["learner_job"] = rj["template"]["spec"]
                    assert rj["replicas"] == 1
    return out


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_servers_and_learner_agree(manifest):
    """The learner finds the servers through the headless Service by DNS (its name, namespace and
    the servers' port), runs as one process, and runs the servers' config: same --config, and
    every override a server has."""
    objs = docs(manifest)
    (svc,) = [d for d in objs if d["kind"] == "Service"]
    assert svc["spec"]["clusterIP"] == "None"
    ns = svc["metadata"].get("namespace", "default")
    assert all(d["metadata"].get("namespace", "default") == ns for d in objs)
    pods = _pods(manifest)
    server, learner = pods["server"], pods["learner"]
    assert svc["spec"]["selector"].items() <= server["metadata"]["labels"].items()
    assert not svc["spec"]["selector"].items() <= learner["metadata"]["labels"].items()

    (sc,) = server["spec"]["containers"]
    (lc,) = learner["spec"]["containers"]
    s_args, l_args = sc["command"] + sc["args"], lc["command"] + lc["args"]
    assert s_args[:2] == ["async-rl", "serve"] and l_args[:2] == ["async-rl", "train"]
    port = int(s_args[s_args.index("--port") + 1])
    assert s_args[s_args.index("--host") + 1] == "0.0.0.0"
    (cport,) = sc["ports"]
    assert cport["containerPort"] == port
    (sport,) = svc["spec"]["ports"]
    assert sport["targetPort"] in (port, cport["name"])
    probe = sc["readinessProbe"]["httpGet"]
    assert probe["path"] == "/health" and probe["port"] in (port, cport["name"])

    assert "engine.backend=remote" in l_args
    assert f"engine.servers_dns={svc['metadata']['name']}.{ns}.svc.cluster.local:{port}" in l_args
    assert any(re.fullmatch(r"run\.dir=(gs|s3)://.+", a) for a in l_args), l_args
    config = s_args[s_args.index("--config") + 1]
    assert l_args[l_args.index("--config") + 1] == config and (ROOT / config).is_file()
    overrides = [a for a in s_args if "=" in a]
    assert set(overrides) <= set(l_args), set(overrides) - set(l_args)

    job = pods["learner_job"]
    assert job["completionMode"] == "Indexed" and job["completions"] == 1 and job["parallelism"] == 1
    assert sc["image"] == lc["image"]
    accel = "google.com/tpu" if "tpu" in manifest.name else "nvidia.com/gpu"
    for c, pod in ((sc, server), (lc, learner)):
        assert accel in c["resources"]["limits"]
        if accel == "google.com/tpu":
            sel = pod["spec"]["nodeSelector"]
            assert {"cloud.google.com/gke-tpu-accelerator", "cloud.google.com/gke-tpu-topology"} <= sel.keys()


# --- launch/fleet_local.sh, run -------------------------------------------------------------------

RUN = [*FAST, "data.num_records=16", "rollout.prompts_per_step=2", "data.num_epochs=1"]


def _fleet(tmp_path: Path, run_dir: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHON=sys.executable, JAX_PLATFORMS="cpu", TMPDIR=str(tmp_path), PYTHONUNBUFFERED="1",
               ASYNC_RL_DELAY="generate:0.05")  # slower chunks: the SIGTERM finds the run mid-way
    with log.open("w") as f:
        return subprocess.Popen(["bash", str(ROOT / "launch" / "fleet_local.sh"), "configs/tiny.yaml", "2",
                                 f"run.dir={run_dir}", *RUN], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)


def _server_pids(out: str) -> list[int]:
    return [int(m) for m in re.findall(r"^fleet_local: server \d \(pid (\d+)\) serving on http://127\.0\.0\.1:\d+", out, re.M)]


def _finish(p: subprocess.Popen, log: Path, timeout: float) -> str:
    """The script's output once it exited; past `timeout`, it is stopped (SIGTERM twice: the
    trainer stops at once, the script stops its servers; then SIGKILL) and the test fails."""
    try:
        p.wait(timeout=timeout)
        return log.read_text()
    except subprocess.TimeoutExpired:
        pass
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGTERM, 60), (signal.SIGKILL, 30)):
        p.send_signal(sig)
        try:
            p.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            pass
    out = log.read_text()
    for pid in _server_pids(out):
        if not _stopped(pid):
            os.kill(pid, signal.SIGKILL)
    pytest.fail(f"launch/fleet_local.sh did not end in {timeout} s:\n{out[-4000:]}")


def _stopped(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # exited, not yet reaped by whoever adopted it


@pytest.mark.slow
def test_fleet_local_trains_and_a_sigterm_stops_trainer_and_servers(tmp_path):
    """Two servers and a trainer: SIGTERM to the script saves the step in progress (exit 0) and
    stops the servers; their folder goes with them."""
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    pytest.importorskip("httpx")
    run_dir = tmp_path / "run"
    log = tmp_path / "fleet_local.log"
    p = _fleet(tmp_path, run_dir, log)
    try:
        reached = wait_for_step(run_dir, 1, p, timeout=240)
    except TimeoutError:
        reached = False
    if not reached:
        pytest.fail(f"no step 1 (exit {p.poll()}):\n{_finish(p, log, 1)[-4000:]}")
    p.send_signal(signal.SIGTERM)
    out = _finish(p, log, 120)
    assert p.returncode == 0, out[-4000:]
    pids = _server_pids(out)
    assert len(pids) == 2, out[-4000:]
    assert all(_stopped(pid) for pid in pids)
    assert "SIGTERM: stopping at the next safe point" in out
    assert not list(tmp_path.glob("async_rl_fleet.*")), "the servers' folder was not removed"
    trained = {r["prompt_id"] for r in lineage(run_dir)}
    assert 0 < len(trained) < 16, "the run ended before the SIGTERM"
    assert checkpoint_steps(run_dir), "the trainer did not save at the step boundary"
