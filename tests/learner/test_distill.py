"""On-policy distillation (learner.distill=reverse_kl): the teacher named by a run directory is
resolved and its vocabulary checked, its logprobs give each token an advantage of its own,
the same teacher and rows give the same step bit for bit, and bad teachers are refused in one
line before anything is written."""

import dataclasses
import json
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import checkpoint_steps, run_cli, tree_digest
from test_learner import batch_of, random_rows

from async_rl import config as C
from async_rl.data.tokenizer import ByteTokenizer, CharTokenizer
from async_rl.learner import losses
from async_rl.learner.step import Learner
from async_rl.model import sharding
from async_rl.state import teacher
from async_rl.state.layout import meta_file, step_dir
from async_rl.state.saved_run import open_run, step_digest

CHAR_VOCAB = CharTokenizer().vocab_size


@pytest.fixture(scope="module")
def teacher_run(tmp_path_factory, xla_cache):
    """A tiny run with a saved step: the teacher."""
    d = tmp_path_factory.mktemp("distill") / "teacher"
    r = run_cli(d, "data.num_records=8", "rollout.prompts_per_step=2", "model.n_layers=1", cache=xla_cache)
    assert r.returncode == 0, r.stderr[-2000:]
    return d


def student_cfg(teacher_dir, *overrides):
    return C.load("configs/tiny.yaml", ["rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
                                       "learner.warmup_steps=0", "learner.lr=3e-3", "model.d_model=32",
                                       "model.d_ff=64", "model.n_layers=1", "learner.distill=reverse_kl",
                                       f"learner.teacher={teacher_dir}", *overrides])


def test_policy_loss_takes_a_per_token_advantage():
    rs = np.random.RandomState(0)
    logp, behav = (jnp.asarray(rs.randn(3, 5) * 0.1 - 2, jnp.float32) for _ in range(2))
    adv_B = jnp.asarray(rs.randn(3), jnp.float32)
    mask = jnp.asarray(rs.rand(3, 5) > 0.2)
    kw = dict(clip_eps=0.2, correction="none", is_cap=2.0)
    per_row, _ = losses.policy_loss(logp, behav, adv_B, mask, **kw)
    per_token, _ = losses.policy_loss(logp, behav, jnp.broadcast_to(adv_B[:, None], (3, 5)), mask, **kw)
    assert float(per_row) == float(per_token)
    # a token whose advantage changes moves the loss by its own surrogate only
    bumped = jnp.broadcast_to(adv_B[:, None], (3, 5)).at[0, 0].add(1.0)
    moved, _ = losses.policy_loss(logp, behav, bumped, mask, **kw)
    ratio = float(jnp.exp(logp[0, 0] - behav[0, 0]))
    expect = -min(ratio, np.clip(ratio, 0.8, 1.2)) * float(mask[0, 0]) / float(mask.sum())
    assert float(moved) - float(per_token) == pytest.approx(expect, abs=1e-5)


def test_a_run_teacher_resolves_and_a_foreign_vocabulary_is_refused_naming_both(teacher_run, tmp_path):
    cfg = student_cfg(teacher_run)
    spec = teacher.resolve(cfg, CharTokenizer())
    assert spec.kind == "run" and spec.model.n_layers == 1 and spec.vocab == CHAR_VOCAB
    with pytest.raises(C.ConfigError, match=r"learner.teacher=.*CharTokenizer.*is not the student's ByteTokenizer"):
        teacher.resolve(cfg, ByteTokenizer())
    for bad, why in ((tmp_path / "none", "no such directory"), (tmp_path, "neither a run directory")):
        with pytest.raises(C.ConfigError, match=why):
            teacher.resolve(student_cfg(bad), CharTokenizer())
    empty = tmp_path / "empty_run"
    empty.mkdir()
    (empty / "config.yaml").write_text((teacher_run / "config.yaml").read_text())
    with pytest.raises(C.ConfigError, match="not a run with a saved step"):
        teacher.resolve(student_cfg(empty), CharTokenizer())


def _step(cfg, spec, rows):
    mesh = sharding.make_devices(cfg.mesh).learner
    t = spec and teacher.Teacher(spec, mesh, CHAR_VOCAB)
    learner = Learner(cfg, CHAR_VOCAB, mesh, log=lambda m: None, teacher=t, n_tokens=CHAR_VOCAB)
    state = learner.init_state(learner.init_params())
    state, metrics = learner.step(state, batch_of(cfg, rows))
    return learner, jax.device_get(state), jax.device_get(metrics)


def test_the_teacher_s_logprobs_set_each_token_s_advantage_and_recompute_bit_identically(teacher_run):
    cfg = student_cfg(teacher_run)
    spec = teacher.resolve(cfg, CharTokenizer())
    rows = random_rows(cfg, seed=3)
    b = batch_of(cfg, rows)
    learner, s1, m1 = _step(cfg, spec, rows)
    t = learner.teacher
    model = __import__("flax").nnx.merge(t.graphdef, t.params())
    t_logp = np.asarray(jax.jit(lambda d: learner._model_logprobs(model, d)[0])(b.device_dict()))
    mask = b.mask_BxN & b.row_valid_B[:, None]
    assert m1["learner/teacher_logp"] == pytest.approx(t_logp[mask].mean(), rel=1e-5)
    assert m1["learner/distill_reverse_kl"] == pytest.approx((b.behav_logp_BxN - t_logp)[mask].mean(), rel=1e-5)
    assert m1["learner/student_logp"] == pytest.approx(b.behav_logp_BxN[mask].mean(), rel=1e-5)
    # a second learner, loading the teacher again, trains the same rows to the same bits (a resume)
    _, s2, m2 = _step(cfg, spec, rows)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)))
    assert {k: float(v) for k, v in m1.items()} == {k: float(v) for k, v in m2.items()}
    # with distill_coef 0 the teacher changes nothing: the update is the reward's alone
    _, s0, _ = _step(dataclasses.replace(cfg, learner=dataclasses.replace(cfg.learner, distill_coef=0.0)), spec, rows)
    plain = dataclasses.replace(cfg, learner=dataclasses.replace(cfg.learner, distill="none", teacher=""))
    _, sp, _ = _step(plain, None, rows)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(s0), jax.tree.leaves(sp)))
    assert not all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(s1), jax.tree.leaves(sp)))


@pytest.mark.parametrize("override, says", [
    ("learner.teacher={missing}", "learner.teacher='{missing}': no such directory"),
    ("learner.distill_coef=-0.5", "learner.distill_coef=-0.5: must be a finite number >= 0"),
    ("learner.distill_coef=nan", "learner.distill_coef='nan': must be a finite number"),
])
def test_a_bad_teacher_or_coefficient_exits_2_in_one_line_and_writes_nothing(tmp_path, teacher_run, override, says):
    missing = str(tmp_path / "no_teacher")
    ov = [f"learner.teacher={teacher_run}", override.format(missing=missing)]
    r = subprocess.run([sys.executable, "-m", "async_rl", "train", "--config", "configs/tiny.yaml",
                        f"run.dir={tmp_path / 'run'}", "learner.distill=reverse_kl", *ov],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    last = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()][-1]
    assert last.startswith("error: " + says.format(missing=missing))
    assert not (tmp_path / "run").exists()


def test_a_teacher_whose_every_step_is_damaged_exits_2_in_one_line_and_writes_nothing(tmp_path, teacher_run):
    bad = tmp_path / "damaged_teacher"
    shutil.copytree(teacher_run, bad)
    for step in checkpoint_steps(bad):  # each step's meta no longer matches its signature
        meta = meta_file(step_dir(bad / "checkpoints", step))
        meta.write_text(meta.read_text().replace('"seed": ', '"seed": 1', 1))
    r = subprocess.run([sys.executable, "-m", "async_rl", "train", "--config", "configs/tiny.yaml",
                        f"run.dir={tmp_path / 'run'}", "learner.distill=reverse_kl", f"learner.teacher={bad}"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    last = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()][-1]
    assert last.startswith(f"error: learner.teacher='{bad}': its weights cannot be read (") and "verifies" in last
    assert last.endswith("nothing was changed")
    assert not (tmp_path / "run").exists()


def test_a_teacher_too_large_to_fit_beside_the_student_is_refused_before_it_is_read(teacher_run, tmp_path):
    import shutil

    import yaml
    from helpers import cfg

    from async_rl.run.train import train
    big = tmp_path / "big_teacher"
    shutil.copytree(teacher_run, big)
    doc = yaml.safe_load((big / "config.yaml").read_text())
    doc["model"].update(d_model=65536, n_layers=64, d_ff=131072)
    (big / "config.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(C.ConfigError, match=r"the run needs at least .* teacher \d+(\.\d+)? [GT]iB"):
        train(cfg(tmp_path / "run", "learner.distill=reverse_kl", f"learner.teacher={big}"))
    assert not (tmp_path / "run" / "lineage.jsonl").exists()


def test_masked_tokens_are_never_distilled_and_a_lora_student_learns_from_the_teacher(teacher_run):
    """An env's observation tokens (and padding) are out of the loss mask: their distillation
    advantage is 0 whatever the teacher says. A LoRA student trains its adapters alone."""
    cfg = student_cfg(teacher_run, "learner.lora_rank=4")
    spec = teacher.resolve(cfg, CharTokenizer())
    rows = random_rows(cfg, seed=5)
    b = batch_of(cfg, rows)
    hole = b.mask_BxN.copy()
    hole[:, 1] = False  # column 1 of every row: an observation the env wrote
    b = dataclasses.replace(b, mask_BxN=hole)
    mesh = sharding.make_devices(cfg.mesh).learner
    learner = Learner(cfg, CHAR_VOCAB, mesh, log=lambda m: None, teacher=teacher.Teacher(spec, mesh, CHAR_VOCAB),
                      n_tokens=CHAR_VOCAB)
    d = b.device_dict()
    rows_d = dict(d, mask_BxN=d["mask_BxN"] & d["row_valid_B"][:, None])
    adv, _ = jax.jit(lambda tp, r: learner._distill(tp, r, jnp.zeros(r["rewards_B"].shape)))(
        learner.teacher.params(), rows_d)
    adv = np.asarray(adv)
    assert np.all(adv[:, 1] == 0) and np.all(adv[~np.asarray(rows_d["mask_BxN"])] == 0)
    assert np.abs(adv[np.asarray(rows_d["mask_BxN"])]).min() > 0
    state = learner.init_state(learner.init_params())
    before = jax.device_get(state["params"])
    state, metrics = learner.step(state, b)
    after = jax.device_get(state["params"])
    assert np.isfinite(float(metrics["learner/distill_reverse_kl"]))
    assert any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after)))


def test_a_resume_pins_the_recorded_teacher_and_refuses_another_in_one_line(teacher_run):
    """`pin` (a resume): the recorded run step is the one read, whatever the teacher run holds
    newer; another digest, or another kind of teacher, is refused naming what was recorded."""
    spec = teacher.resolve(student_cfg(teacher_run), CharTokenizer())
    mesh = sharding.make_devices(student_cfg(teacher_run).mesh).learner
    last = checkpoint_steps(teacher_run)[-1]
    ref = {"kind": "run", "path": "/elsewhere/then", "step": last, "digest": step_digest(open_run(teacher_run), last)}
    t, said = teacher.Teacher(spec, mesh, CHAR_VOCAB), []
    t.pin(dict(ref), "RUN (step 3)", log=said.append)
    assert t.spec.step == last and t.reference() == dict(ref, path=str(teacher_run))
    assert said == [f"teacher: {teacher_run} holds the teacher RUN (step 3) was trained with, at /elsewhere/then then"]
    t.pin(None, "RUN (step 3)")  # a checkpoint from before distillation was on: nothing to pin
    with pytest.raises(C.ConfigError, match=r"^learner.teacher=.*: the checkpoint in RUN \(step 3\) was trained with the "
                                            r"teacher run '/elsewhere/then' step \d+ \(digest 00\); this teacher's digest is "
                                            r"[0-9a-f]+; .*restore that teacher or use a new run.dir \(nothing was changed\)$"):
        teacher.Teacher(spec, mesh, CHAR_VOCAB).pin(dict(ref, digest="00"), "RUN (step 3)")
    with pytest.raises(C.ConfigError, match=r"teacher hf '/elsewhere/then', a run directory now"):
        teacher.Teacher(spec, mesh, CHAR_VOCAB).pin(dict(ref, kind="hf"), "RUN (step 3)")



def test_an_hf_teacher_is_recorded_by_its_files_digest_and_a_changed_or_missing_one_refused(teacher_run, tmp_path):
    from async_rl.model.lora import files_digest
    run_spec = teacher.resolve(student_cfg(teacher_run), CharTokenizer())
    mesh = sharding.make_devices(student_cfg(teacher_run).mesh).learner
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    (hf_dir / "model.safetensors").write_bytes(b"weights v1")
    spec = dataclasses.replace(run_spec, path=str(hf_dir), kind="hf")
    ref = {"kind": "hf", "path": str(hf_dir), "digest": files_digest(hf_dir)}
    t = teacher.Teacher(spec, mesh, CHAR_VOCAB)
    t.pin(dict(ref), "RUN (step 3)")
    assert t.reference() == ref
    (hf_dir / "model.safetensors").write_bytes(b"weights v2")
    with pytest.raises(C.ConfigError, match=r"teacher hf '.*/hf' \(digest [0-9a-f]+\); this teacher's digest is"):
        teacher.Teacher(spec, mesh, CHAR_VOCAB).pin(dict(ref), "RUN (step 3)")
    shutil.rmtree(hf_dir)
    with pytest.raises(C.ConfigError, match=r"teacher hf '.*/hf', which '.*/hf' no longer holds whole"):
        teacher.Teacher(spec, mesh, CHAR_VOCAB).pin(dict(ref), "RUN (step 3)")


@pytest.mark.slow
def test_a_resumed_student_reads_its_teacher_s_recorded_step_after_the_teacher_trained_on_and_moved(
        teacher_run, tmp_path, xla_cache):
    """Each checkpoint records the teacher step it was trained with; the teacher run training on
    (a newer step) and moving change nothing in the student's resume, which reads that step. A
    teacher that lost the step is refused in one line, exit 2, the student's run untouched."""
    a, student = tmp_path / "teacher", tmp_path / "student"
    shutil.copytree(teacher_run, a)
    t0 = checkpoint_steps(a)[-1]
    small = ["data.num_records=8", "rollout.prompts_per_step=2", "model.n_layers=1"]
    distill = [*small, "learner.distill=reverse_kl", "rollout.reward=none"]
    r = run_cli(student, *distill, f"learner.teacher={a}", "train.max_steps=2", cache=xla_cache)
    assert r.returncode == 0, r.stderr[-2000:]
    meta = lambda s: json.loads(meta_file(step_dir(student / "checkpoints", s)).read_text())  # noqa: E731
    recorded = meta(2)["teacher"]
    assert recorded == {"kind": "run", "path": str(a), "step": t0, "digest": step_digest(open_run(a), t0)}
    r = run_cli(a, *small, "data.num_epochs=2", cache=xla_cache)  # the teacher trains on
    assert r.returncode == 0, r.stderr[-2000:]
    assert checkpoint_steps(a)[-1] > t0 and t0 in checkpoint_steps(a)
    b = a.rename(tmp_path / "moved")
    r = run_cli(student, *distill, f"learner.teacher={b}", "train.max_steps=3", cache=xla_cache)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout + r.stderr
    assert f"teacher: run {b} step {t0}:" in out and f"teacher: {b} holds the teacher" in out
    assert meta(3)["teacher"] == dict(recorded, path=str(b))
    shutil.rmtree(step_dir(b / "checkpoints", t0))  # as the teacher run's checkpoint.keep would
    before = tree_digest(student)
    r = run_cli(student, *distill, f"learner.teacher={b}", "train.max_steps=4", cache=xla_cache)
    assert r.returncode == 2, r.stderr[-2000:]
    last = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()][-1]
    assert last.startswith(f"error: learner.teacher='{b}': the checkpoint in ") and f"step {t0}, which" in last
    assert tree_digest(student) == before
