"""`specdec distill` (self-distillation data) and `specdec train-drafter` on its folder, on the tiny chat bundle.

The data must be the target's: each greedy answer is the target's greedy decoding of the prompt
through the chat template, each sampled one is what the same request (its seed) gives alone, and
the log-probabilities are the target's. A run stopped early and resumed answers every job once,
with the same answers as one uninterrupted run; topics are split, never lines.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from specdec.held_out import HELD_OUT, HELD_OUT_CODE  # noqa: E402
from specdec.commands.distill import prompts as P  # noqa: E402
from specdec.commands.distill.run import Settings, distill  # noqa: E402
from specdec.shards import answers, shard_paths  # noqa: E402
from specdec.errors import ConfigError  # noqa: E402
from specdec.export import train_head  # noqa: E402

# "topic 89" and "topic 126" are held out by train-drafter's split (export/head_data.py: held_out_topic)
REQUESTS = [{"topic": f"topic {i}", "kind": "chat", "prompt": f"Tell me about thing number {i}."} for i in (3, 5, 89, 126, 7, 9)]
REQUESTS.append({"topic": "topic 4", "kind": "chat", "instruct": "Write one question about topic 4."})
SETTINGS = Settings(max_new_tokens=12, seed=3, shard_size=3, requests=REQUESTS)
ROOT = Path(__file__).resolve().parents[1]


def by_job(folder):
    return {a.job: a for a in answers(folder)}


@pytest.fixture(scope="module")
def whole(chat_bundle, tmp_path_factory):
    """One uninterrupted run over every job."""
    out = tmp_path_factory.mktemp("distill") / "whole"
    record = distill(chat_bundle[1], out, SETTINGS, max_batch=4, progress=False, report=lambda s: None)
    return out, record


def test_answers_are_the_targets(whole, chat_bundle):
    """Greedy jobs equal SpeculativeDecoder's greedy decoding (γ = 0) of the same chat prompt;
    sampled jobs equal the same request alone (its own seed); the top-K log-probabilities are
    the target's raw ones at each answer position."""
    from specdec.runtime import SpeculativeDecoder
    from specdec.serve.chat import bundle_template

    out, record = whole
    plan = json.loads((out / "plan.json").read_text())
    assert record["answers"] == record["jobs"] == 2 * len(plan["requests"])
    dec = SpeculativeDecoder.load(chat_bundle[1])
    chat = bundle_template(chat_bundle[1], dec.manifest, dec.codec)
    got = by_job(out)
    assert sorted(got) == list(range(record["jobs"]))
    for job, a in got.items():
        r = plan["requests"][job // 2]
        prompt = dec.codec.encode(chat.render([{"role": "user", "content": r["prompt"]}]))
        assert a.prompt == prompt
        res = dec.generate(prompt, max_new_tokens=12, temperature=(0.0, 1.0)[job % 2], seed=3 * 1_000_003 + job, gamma=0, logprobs=20)
        assert a.answer == res.tokens, f"job {job}"
        assert a.top_id.shape == (len(a.answer), 20)
        assert a.top_id[:, 0].tolist() == [x.top[0][0] for x in res.logprobs]
        np.testing.assert_allclose(a.top_lp.astype(np.float32), [[lp for _, lp in x.top] for x in res.logprobs], rtol=1e-3, atol=1e-4)  # float16 storage: 2^-11 relative


def test_a_stopped_run_resumes_to_the_same_data(whole, chat_bundle, tmp_path):
    """Stopped at a token budget, then resumed (twice: the second finds nothing to do): every
    job answered once, answers equal to the uninterrupted run's; a stale temporary shard is ignored."""
    out = tmp_path / "resumed"
    first = distill(chat_bundle[1], out, SETTINGS, max_batch=2, tokens=10, progress=False, report=lambda s: None)
    assert first["answers"] < first["jobs"]
    kept = by_job(out)
    (out / ".shard-00099.npz.partial").write_bytes(b"half a shard")  # what an interrupted write leaves
    second = distill(chat_bundle[1], out, SETTINGS, max_batch=4, progress=False, report=lambda s: None)
    third = distill(chat_bundle[1], out, SETTINGS, max_batch=4, progress=False, report=lambda s: None)
    assert second["answers"] == second["jobs"] and third["this_run"]["answers"] == 0
    got, ref = by_job(out), by_job(whole[0])
    assert sum(1 for _ in answers(out)) == len(got) == len(ref)  # no job twice
    assert all(got[j].answer == kept[j].answer for j in kept)
    assert {j: a.answer for j, a in got.items()} == {j: a.answer for j, a in ref.items()}
    assert (out / "plan.json").read_text() == (whole[0] / "plan.json").read_text()


def test_other_settings_in_the_folder_are_refused(whole, chat_bundle, tmp_path):
    out = tmp_path / "other"
    shutil.copytree(whole[0], out)
    with pytest.raises(ConfigError, match="other settings"):
        distill(chat_bundle[1], out, Settings(max_new_tokens=5, seed=3, shard_size=3, requests=REQUESTS), max_batch=2, progress=False)


def test_cli_bad_temperatures_exit_2(chat_bundle, tmp_path):
    run = subprocess.run([sys.executable, "-m", "specdec", "distill", str(chat_bundle[1]), "--out", str(tmp_path / "d"), "--temperatures", "0,hot"],
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 2
    assert "--temperatures '0,hot': expected comma-separated numbers" in run.stderr
    assert not shard_paths(tmp_path / "d")


def test_cli_ctrl_c_keeps_whole_shards_and_says_how_to_resume(chat_bundle, tmp_path):
    """SIGINT while answering: exit 0, every shard on disk whole, the line says to run it again."""
    out = tmp_path / "d"
    cmd = [sys.executable, "-m", "specdec", "distill", str(chat_bundle[1]), "--out", str(out), "--docs", "0", "--max-new-tokens", "8", "--no-progress"]
    # as from a terminal: SIGINT's default action in the child (an xdist worker can carry it ignored, which a child inherits)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    deadline = time.monotonic() + 120
    while not (out / "shard-00001.npz").is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-2000:]
    assert "interrupted: run the same command to resume" in stdout
    record = json.loads((out / "progress.json").read_text())
    assert record["interrupted"] and 0 < record["answers"] < record["jobs"]
    assert sum(1 for _ in answers(out)) == record["answers"]  # every shard reads whole


def test_self_instruct_keeps_only_questions(whole):
    plan = json.loads((whole[0] / "plan.json").read_text())
    assert plan["self_instruct"]["asked"] == 1
    kept = [r for r in plan["requests"] if r.get("self_instruct")]
    assert len(kept) == plan["self_instruct"]["kept"] and all(P.looks_like_question(r["prompt"]) for r in kept)
    assert P.looks_like_question("How do glaciers move?") and P.looks_like_question('"Why is it cold?"')
    assert not P.looks_like_question("Glaciers move.") and not P.looks_like_question("Why?\nBecause?") and not P.looks_like_question("Why?")


def test_topics_split_and_bench_topics_left_out():
    """No topic is on both sides; the benchmark's held-out topics are on neither; about 1 in 8 held out."""
    train = P.requests(held_out=False, docs=0)
    held = P.requests(held_out=True, docs=0)
    t_train, t_held = {r["topic"] for r in train}, {r["topic"] for r in held}
    assert not t_train & t_held and t_held
    assert not (t_train | t_held) & P.BENCH_TOPICS
    assert 0.06 < len(t_held) / len(t_train | t_held) < 0.2
    assert all(P.is_held_out(t) for t in t_held)
    assert P.held_out("chat", 5, seed=0) == P.held_out("chat", 5, seed=0) and len(P.held_out("chat", 5)) == 5


def test_train_drafter_on_distilled_data(whole, chat_bundle, tmp_path):
    """train-drafter reads a distill folder: only answer positions are trained on, topics 89/126 held out."""
    from specdec.export.head_data import distilled, held_out_topic
    from specdec.export.train_head import Recipe, train

    assert [held_out_topic(r["topic"]) for r in REQUESTS[:6]] == [False, False, True, True, False, False]
    train_seqs, held = distilled(str(whole[0]), 512)
    kept = [a for a in answers(whole[0]) if a.job // 2 not in (2, 3)]
    assert len(held) == 4 and len(train_seqs) == len(kept)
    for a, ids, mask in zip(kept, train_seqs.ids, train_seqs.mask):  # position j predicts token j + 1: answer tokens only
        assert ids.tolist() == a.prompt + a.answer
        assert np.flatnonzero(mask).tolist() == list(range(len(a.prompt) - 1, len(ids) - 1))
    bundle = tmp_path / "bundle"
    shutil.copytree(chat_bundle[1], bundle)
    record = train(bundle, str(whole[0]), Recipe(steps=20, batch=2, window=64, lr=3e-3, noise=0.0, bf16=True), report=lambda s: None)
    assert record["conversations"] == len(train_seqs) and record["held_out_conversations"] == 4
    assert record["trained_positions"] == sum(len(a.answer) for a in kept)
    assert record["held_out"]["after"]["alpha_t1"] > record["held_out"]["before"]["alpha_t1"]
    # the target's features are kept in the folder: a second recipe reads them back, the same figures from the same start
    again, lines = tmp_path / "again", []
    shutil.copytree(chat_bundle[1], again)
    second = train(again, str(whole[0]), Recipe(steps=1, batch=2, window=64, seed=0), report=lines.append)
    assert sum("target features read from" in line for line in lines) == 2  # training and held-out conversations
    assert second["held_out"]["before"] == record["held_out"]["before"]


def test_a_stopped_training_goes_on_from_its_checkpoint_to_the_same_head(whole, chat_bundle, tmp_path):
    """train-drafter --checkpoint: a run interrupted at step 50 of 100 (Ctrl-C) and run again
    ends with the very weights of one uninterrupted run (same batches, noise and AdamW moments:
    bit for bit on one machine); a run with another recipe is refused in one line naming it."""
    from safetensors.torch import load_file

    recipe = train_head.Recipe(steps=100, batch=2, window=64, lr=3e-3, seed=5)

    def run(name, checkpoint=None, report=lambda s: None, r=recipe):
        bundle = tmp_path / name
        if not bundle.exists():
            shutil.copytree(chat_bundle[1], bundle)
        return train_head.train(bundle, str(whole[0]), r, save=tmp_path / f"{name}-head", report=report, checkpoint=checkpoint)

    straight = run("straight")

    def stop_at_50(line):
        if line.startswith("step 50/"):
            raise KeyboardInterrupt

    ck = tmp_path / "train.ckpt"
    with pytest.raises(KeyboardInterrupt):
        run("resumed", ck, stop_at_50)
    assert ck.is_file() and not (tmp_path / "resumed-head").exists()
    with pytest.raises(ConfigError, match=r"--checkpoint .*train.ckpt: saved by a run with other --lr \(0.003 there, 0.001 here\)"):
        run("other", ck, r=train_head.Recipe(steps=100, batch=2, window=64, lr=1e-3, seed=5))
    lines = []
    resumed = run("resumed", ck, lines.append)
    assert any("training goes on from" in line and "at step 50/100" in line for line in lines), lines
    assert resumed["steps_done"] == straight["steps_done"] == 100 and resumed["runs"] == 2
    assert resumed["held_out"] == straight["held_out"] and resumed["log"] == straight["log"]
    a, b = (load_file(str(tmp_path / f"{n}-head" / "head.safetensors")) for n in ("straight", "resumed"))
    assert a.keys() == b.keys() and all(torch_equal(a[k], b[k]) for k in a)
    # through the CLI: a run bounded by its time stops early and says how to go on; the same command, unbounded, ends the schedule
    from click.testing import CliRunner

    from specdec.commands.cli.main import cli

    bundle = tmp_path / "cli"
    shutil.copytree(chat_bundle[1], bundle)
    args = ["train-drafter", str(bundle), "--corpus", str(whole[0]), "--steps", "100", "--batch", "2", "--window", "64", "--lr", "3e-3", "--seed", "5",
            "--checkpoint", str(tmp_path / "cli.ckpt")]  # fmt: skip
    first = CliRunner().invoke(cli, [*args, "--train-minutes", "1e-9"])
    assert first.exit_code == 0, first.output
    assert "0/100 steps: the same command goes on from" in first.output and "feature drafter written into" in first.output
    second = CliRunner().invoke(cli, args)
    assert second.exit_code == 0 and "steps: the same command" not in second.output, second.output
    assert f"held-out α(T=1) {straight['held_out']['after']['alpha_t1']}," in second.output  # the same schedule as the straight run


def torch_equal(x, y) -> bool:
    import torch

    return bool(torch.equal(x, y))


def test_a_plan_answered_by_transformers_is_the_targets_data(whole, chat_bundle, tmp_path):
    """The GPU path (tools/gpu/drafter.py): ``specdec distill --plan-only`` here, the jobs answered
    by the same target in transformers, many rows per forward (specdec/commands/distill/hf.py), in shards
    the folder reads as its own. Greedy answers are the bundle's greedy decoding token for token,
    their top-20 the bundle's log-probabilities (float32 in two runtimes, both stored in float16);
    the features are what the LM head reads (their logits give the same top token); then the tool
    trains a head on them that export can load."""
    import torch
    from transformers import AutoModelForCausalLM

    from specdec.commands.distill.hf import answer_all
    from specdec.commands.distill.run import plan_only, read_prompts
    from specdec.shards import write_shard
    from specdec.export.head_data import distilled

    out = tmp_path / "plan"
    summary = plan_only(chat_bundle[1], out, SETTINGS, max_batch=4, report=lambda s: None)
    assert (out / "plan.json").read_text() == (whole[0] / "plan.json").read_text()  # the same plan as a whole run's
    prompts, eos, max_seq = read_prompts(out)
    assert summary["jobs"] == 2 * len(prompts) and max_seq == 512
    ref = by_job(whole[0])
    model = AutoModelForCausalLM.from_pretrained(str(chat_bundle[0]), dtype=torch.float32).eval()
    got = list(answer_all(model, prompts, [0.0, 1.0], eos, 12, rows=3, top_k=20, seed=3))
    assert sorted(a.answer.job for a in got) == sorted(ref)
    head_t = model.get_output_embeddings().weight.detach().float().numpy().T  # [d, V]
    for a in got:
        assert a.answer.prompt == ref[a.answer.job].prompt
        n, p = len(a.answer.answer), len(a.answer.prompt)
        assert a.feats.shape == (p + n, head_t.shape[0]) and a.answer.top_id.shape == (n, 20)
        top1 = (a.feats[p - 1 : p + n - 1].astype(np.float32) @ head_t).argmax(-1)
        assert top1.tolist() == a.answer.top_id[:, 0].tolist()  # the features are the LM head's input
        if a.answer.job % 2 == 0:  # greedy: the target's own tokens and log-probabilities
            want = ref[a.answer.job]
            assert a.answer.answer == want.answer, f"job {a.answer.job}"
            # both stored in float16 (2^-10 relative spacing): float32 values a hair apart may round one step apart
            np.testing.assert_allclose(a.answer.top_lp[:, :5].astype(np.float32), want.top_lp[:, :5].astype(np.float32), rtol=2e-3, atol=1e-4)
        else:
            assert n <= 12 and (n == 12 or a.answer.answer[-1] in eos)
    # features of answers made elsewhere (a corpus brought back): one forward each, what the decoding passes gave
    from specdec.commands.distill.hf import features

    again = {job: (f, top) for job, f, top in features(model, [a.answer for a in got], rows=2, top_k=5)}
    for a in got:
        f, (top_id, top_lp) = again[a.answer.job]
        assert f.shape == a.feats.shape and not f[-1].any()
        # both float16 (2^-11 relative spacing), one from a prefill and one from cached decoding steps: 1% of the largest value
        assert np.abs(f.astype(np.float32) - a.feats).max() <= 1e-2 * np.abs(a.feats).max(), f"job {a.answer.job}"
        # the labels of that forward are the decoding's (a corpus that came back with its top-1 gets them again)
        assert top_id.shape == (len(a.answer.answer), 5) and top_id[:, 0].tolist() == a.answer.top_id[:, 0].tolist()
        np.testing.assert_allclose(top_lp[:, :3].astype(np.float32), a.answer.top_lp[:, :3].astype(np.float32), rtol=2e-3, atol=1e-3)
    # under bfloat16 autocast (a CPU's faster forward): the features stay close, the same top label nearly everywhere
    low = {job: (f, top) for job, f, top in features(model, [a.answer for a in got], rows=2, top_k=1, bf16=True)}
    ref_f = np.concatenate([a.feats[:-1] for a in got]).astype(np.float32)
    low_f = np.concatenate([low[a.answer.job][0][:-1] for a in got]).astype(np.float32)
    # bfloat16 keeps 8 bits of mantissa (2^-9 relative rounding) through 2 layers: 5% of the features' norm bounds it loosely
    assert np.linalg.norm(low_f - ref_f) <= 0.05 * np.linalg.norm(ref_f)
    same = np.mean(np.concatenate([low[a.answer.job][1][0][:, 0] == a.answer.top_id[:, 0] for a in got]))
    assert same >= 0.9, same
    write_shard(out, 0, [a.answer for a in got])
    train, held = distilled(str(out), max_seq, features={a.answer.job: a.feats for a in got})
    assert len(train) and len(held) and all(len(f) == len(i) for f, i in zip(train.feats, train.ids))

    # the tool end to end on a fresh copy of the plan, on the CPU: a head that export loads
    data = tmp_path / "data"
    data.mkdir()
    for name in ("plan.json", "prompts.npz"):
        shutil.copyfile(out / name, data / name)
    tool = [sys.executable, str(ROOT / "tools" / "gpu" / "drafter.py"), "--data", str(data), "--model", str(chat_bundle[0]), "--out", str(tmp_path / "o"),
            "--device", "cpu", "--rows", "4", "--steps", "45", "--batch", "2", "--window", "64", "--draft-vocab", "64", "--corpus-top", "2"]  # fmt: skip
    run = subprocess.run([*tool, "--train-minutes", "0.0001"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads((tmp_path / "o" / "drafter.json").read_text())
    assert record["answering"]["answers"] == summary["jobs"] and record["held_out"]["after"]["argmax_t0"] >= 0
    # a time-bounded fit: the step count set after the steps it timed, within --steps
    assert record["steps"] == train_head.CALIBRATE + 1 and "steps fit" in run.stdout
    # the answers come back as a corpus with the top-2 labels, in the folder's own format
    with tarfile.open(tmp_path / "o" / "corpus.tar.xz") as tar:
        tar.extractall(tmp_path / "back", filter="data")
    back = {a.job: a for a in answers(tmp_path / "back" / "corpus")}
    assert record["corpus_archive"]["top_k"] == 2 and sorted(back) == sorted(by_job(data))
    for job, a in by_job(data).items():
        assert back[job].answer == a.answer and back[job].top_id.tolist() == a.top_id[:, :2].tolist()
    # that corpus trains again elsewhere with nothing more answered (--minutes 0): the features come from one forward each
    # and a whole-run deadline already past leaves training the fewest steps
    # with the top-4 labels of that forward written back into its shards, and its features kept for a run after it
    again = [*tool[: tool.index("--data") + 1], str(tmp_path / "back" / "corpus"), *tool[tool.index("--data") + 2 :], "--minutes", "0", "--deadline-minutes", "0.01",
             "--relabel", "4", "--features-cache", str(tmp_path / "cache")]  # fmt: skip
    again_run = subprocess.run(again, capture_output=True, text=True, timeout=600)
    assert again_run.returncode == 0, again_run.stderr[-3000:]
    second = json.loads((tmp_path / "o" / "drafter.json").read_text())
    assert second["answering"]["answers"] == 0 and second["earlier_answers"]["answers"] == summary["jobs"]
    assert second["earlier_answers"]["computed"] == summary["jobs"] == second["earlier_answers"]["relabeled"]
    relabeled = {a.job: a for a in answers(tmp_path / "back" / "corpus")}
    for job, a in by_job(data).items():
        assert relabeled[job].top_id.shape[1] == 4 and relabeled[job].top_id[:, 0].tolist() == a.top_id[:, 0].tolist()
    assert len(list((tmp_path / "cache").glob("*.npz"))) == summary["jobs"]
    shutil.copytree(tmp_path / "o" / "head", tmp_path / "first")
    third = subprocess.run([*again, "--init", str(tmp_path / "first")], capture_output=True, text=True, timeout=600)  # the features read back: no forward
    assert third.returncode == 0, third.stderr[-3000:]
    record = json.loads((tmp_path / "o" / "drafter.json").read_text())
    assert record["earlier_answers"]["computed"] == 0
    # and training went on from the head before it (its draft vocabulary kept), from where that one ended
    assert record["init"] == str(tmp_path / "first") and "training goes on from" in third.stdout
    assert record["held_out"]["before"] == second["held_out"]["after"]
    assert second["steps"] == train_head.CALIBRATE + 1
    assert second["conversations"] == record["conversations"] and second["tokens"] == record["tokens"]
    # an EAGLE-3 head over two layers' streams (their own features cache), from its checkpoint: saved in Speculators' layout
    cache = again.index("--features-cache") + 1
    eagle = [*again[:cache], str(tmp_path / "cache3"), *again[cache + 1 :], "--aux-layers", "0,1", "--checkpoint", str(tmp_path / "e3.ckpt")]
    fourth = subprocess.run(eagle, capture_output=True, text=True, timeout=600)
    assert fourth.returncode == 0, fourth.stderr[-3000:]
    from specdec.export import eagle3

    spec = eagle3.read(tmp_path / "o" / "head")
    assert eagle3.is_eagle3(tmp_path / "o" / "head") and spec.aux_layers == (0, 1) and spec.draft_vocab == 64
    assert (tmp_path / "e3.ckpt").is_file() and json.loads((tmp_path / "cache3" / "cache.json").read_text())["layers"] == [0, 1]
    from specdec.export.head import load_head

    embed = model.get_input_embeddings().weight.detach().float()
    head, _ = load_head(tmp_path / "first", embed, torch.from_numpy(head_t.copy()), bool(model.config.tie_word_embeddings))
    assert head.cfg.draft_vocab == 64 and head.cfg.max_positions == 512


def test_a_time_bounded_fit_refits_its_step_count_to_the_rate_it_sees():
    """``--train-minutes``: the step count is the rest of the time over the rate of the latest
    steps, bounded by one more step and the recipe's cap; a calibration on a busy machine (twice
    the true step time) is corrected at the next refit instead of ending the run early."""
    from specdec.export.train_head import fit_steps

    assert fit_steps(40, 10.0, 100.0, 0.5, 10_000) == 40 + 180
    assert fit_steps(40, 120.0, 100.0, 0.5, 10_000) == 41, "past the time: one more step, the one that ends it"
    assert fit_steps(40, 10.0, 1e6, 0.01, 500) == 500, "the recipe's --steps caps it"
    calibrated = fit_steps(40, 20.0, 100.0, 1.0, 10_000)  # steps 10..40 timed beside another job
    refit = fit_steps(90, 45.0, 100.0, 0.5, 10_000)  # steps 40..90 alone: 25 s
    assert (calibrated, refit) == (120, 200)


def test_question_forms_keep_the_topic_split():
    """--forms questions: direct questions and several self-instruct asks per topic, on the same
    topic split as the templates (no held-out or benchmark topic on the training side); an unknown
    set is refused by name."""
    q = P.requests(held_out=False, docs=0, forms="questions")
    t = P.requests(held_out=False, docs=0, forms="templates")
    assert {r["topic"] for r in q} == {r["topic"] for r in t}
    assert not {r["prompt"] for r in q if "prompt" in r} & {r["prompt"] for r in t if "prompt" in r}
    per_topic = {}
    for r in q:
        per_topic[r["topic"]] = per_topic.get(r["topic"], 0) + ("instruct" in r)
    assert set(per_topic.values()) >= {len(P.INSTRUCT_FORMS)}
    asked = [r["prompt"] for r in q if "prompt" in r]
    assert sum(x.endswith("?") for x in asked) > len(asked) // 2
    assert not any(P.is_held_out(r["topic"]) for r in q) and not {r["topic"] for r in q} & P.BENCH_TOPICS
    with pytest.raises(ConfigError, match="forms 'odd': expected one of templates, questions"):
        P.requests(held_out=False, forms="odd")


def test_everyday_forms_widen_the_shapes_on_the_same_split():
    """--forms everyday: request shapes none of the other sets has, every one filled for every
    training topic, none a benchmark prompt, on the same topic split."""
    e = P.requests(held_out=False, docs=0, forms="everyday")
    chat = [r for r in e if r["kind"] == "chat"]
    topics = {r["topic"] for r in chat}
    assert topics == {r["topic"] for r in P.requests(held_out=False, docs=0, forms="templates") if r["kind"] == "chat"}
    assert len(chat) == len(P.EVERYDAY_FORMS) * len(topics) and len({r["prompt"] for r in chat}) == len(chat)
    assert not set(P.EVERYDAY_FORMS) & set(P.FORMS + P.QUESTION_FORMS)
    assert not {r["prompt"].lower() for r in e} & {t.lower() for t in HELD_OUT + HELD_OUT_CODE}
    assert not any(P.is_held_out(r["topic"]) for r in e) and not topics & P.BENCH_TOPICS
    assert {r["prompt"] for r in P.requests(held_out=True, docs=0, forms="everyday")}.isdisjoint({r["prompt"] for r in e})


def test_user_turn_forms_and_what_is_kept_of_them():
    """--forms user-turns: USER_TURNS requests per training topic whose user turn the target
    writes, the same topic split, code questions beside them; a written turn is kept when it
    reads as one request (one paragraph, a sentence's end, no role marker, not a benchmark prompt)."""
    u = P.requests(held_out=False, docs=0, forms="user-turns")
    turns = [r for r in u if r.get("user_turn")]
    assert len(turns) == P.USER_TURNS["user-turns"] * len({r["topic"] for r in turns}) and not any(P.is_held_out(r["topic"]) for r in u)
    assert {r["kind"] for r in u if "prompt" in r} == {"code"}
    assert P.looks_like_request("Can you recommend a healthy and balanced meal plan for a toddler?")
    assert P.looks_like_request("I'm planning a dinner party tonight. Can you help me with the menu?")
    for bad in ("Why is the sky blue?", "SMOLLM: Welcome to our team, how can I help you?", "Plan my trip.\nDay one: Paris.", "Hi there.",
                "Tell me about the Great Lakes and why they"):
        assert not P.looks_like_request(bad), bad


def test_a_user_turn_plan_asks_the_target_from_its_template(chat_bundle, tmp_path):
    """The target is asked with its chat template cut where the user's text begins (the ids that
    open every rendered user turn), and the plan keeps only the turns that read as requests."""
    from specdec.commands.distill.run import _user_prefix, plan_only
    from specdec.manifest import load_manifest
    from specdec.runtime.text import TextCodec
    from specdec.serve.chat import bundle_template

    b = chat_bundle[1]
    m = load_manifest(b)
    codec = TextCodec.from_bundle(b, m)
    chat = bundle_template(b, m, codec)
    prefix = _user_prefix(chat, codec)
    whole = codec.encode(chat.render([{"role": "user", "content": "Hello there"}]))
    assert 0 < len(prefix) < len(whole) and list(whole[: len(prefix)]) == list(prefix)
    reqs = [{"topic": f"topic {i}", "kind": "chat", "user_turn": True} for i in (3, 5, 7, 9)] + REQUESTS[:1]
    plan_only(b, tmp_path / "p", Settings(max_new_tokens=12, seed=3, shard_size=3, requests=reqs, forms="user-turns"), max_batch=2, report=lambda s: None)
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    kept = [r for r in plan["requests"] if r.get("self_instruct")]
    assert plan["self_instruct"] == {"asked": 4, "kept": len(kept)} and REQUESTS[0] in plan["requests"]
    assert all(P.looks_like_request(r["prompt"]) for r in kept)


def test_a_plan_made_before_forms_resumes(whole, chat_bundle, tmp_path):
    """A folder whose plan's settings predate --forms (the templates) resumes with the default settings."""
    out = tmp_path / "old"
    shutil.copytree(whole[0], out)
    plan = json.loads((out / "plan.json").read_text())
    del plan["settings"]["forms"]
    (out / "plan.json").write_text(json.dumps(plan))
    record = distill(chat_bundle[1], out, SETTINGS, max_batch=2, progress=False, report=lambda s: None)
    assert record["this_run"]["answers"] == 0 and record["answers"] == record["jobs"]
    with pytest.raises(ConfigError, match="other settings"):
        distill(chat_bundle[1], out, Settings(max_new_tokens=12, seed=3, shard_size=3, requests=REQUESTS, forms="questions"), max_batch=2, progress=False)


def test_merge_appends_answered_requests_and_keeps_the_first(whole, chat_bundle, tmp_path):
    """specdec distill-merge: the first folder's jobs keep their numbers and answers; the
    second's answered requests are appended, each answer under (its new request, its temperature's
    index among the first's); prompts.npz covers every request; train-drafter's reader takes the
    result whole. Shapes that differ, temperatures outside the first's and an existing --out are refused."""
    from specdec.commands.distill.merge import merge
    from specdec.commands.distill.run import plan_only, read_prompts
    from specdec.export.head_data import distilled

    first = tmp_path / "first"
    shutil.copytree(whole[0], first)
    plan_only(chat_bundle[1], first, SETTINGS, max_batch=2, report=lambda s: None)  # the plan exists: adds prompts.npz
    more = [{"topic": f"topic {i}", "kind": "chat", "prompt": f"Why is thing {i} so odd?"} for i in (11, 13, 15, 17, 19, 21)]
    second = tmp_path / "second"
    s2 = Settings(max_new_tokens=12, temperatures=(1.0,), seed=5, shard_size=2, requests=more)
    rec2 = distill(chat_bundle[1], second, s2, max_batch=1, tokens=1, progress=False, report=lambda s: None)  # stops after the first answer
    assert 0 < rec2["answers"] < len(more)  # some requests left unanswered: they are not carried over
    out = tmp_path / "merged"
    tool = subprocess.run([sys.executable, "-m", "specdec", "distill-merge", str(first), str(second), "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert tool.returncode == 0, tool.stderr
    record = json.loads(tool.stdout)
    plan0, merged = json.loads((first / "plan.json").read_text()), json.loads((out / "plan.json").read_text())
    n0 = len(plan0["requests"])
    assert merged["requests"][:n0] == plan0["requests"]
    assert record["requests"] == len(merged["requests"]) == n0 + rec2["answers"] and record["added"][0]["answers"] == rec2["answers"]
    got, ref0, ref2 = by_job(out), by_job(first), by_job(second)
    assert {j: a.answer for j, a in got.items() if j < 2 * n0} == {j: a.answer for j, a in ref0.items()}
    appended = {j: a for j, a in got.items() if j >= 2 * n0}
    assert len(appended) == len(ref2) and all(j % 2 == 1 for j in appended)  # T = 1 is the first's second temperature
    by_prompt = {merged["requests"][j // 2]["prompt"]: a.answer for j, a in appended.items()}
    assert by_prompt == {more[j]["prompt"]: a.answer for j, a in ref2.items()}
    ids, _, _ = read_prompts(out)
    assert len(ids) == len(merged["requests"])
    assert all(ids[j // 2].tolist() == a.prompt for j, a in got.items())
    train, held = distilled(str(out), 64)
    assert len(train) + len(held) == len(got)
    assert json.loads((first / "plan.json").read_text()) == plan0 and by_job(first).keys() == ref0.keys()  # sources untouched
    with pytest.raises(ConfigError, match="exists: expected a new folder"):
        merge([first, second], out)
    with pytest.raises(ConfigError, match=r"temperatures \[0.0\] are not among"):
        merge([second, first], tmp_path / "m2")
    odd = tmp_path / "odd"
    shutil.copytree(second, odd)
    p = json.loads((odd / "plan.json").read_text())
    p["settings"]["max_new_tokens"] = 99
    (odd / "plan.json").write_text(json.dumps(p))
    with pytest.raises(ConfigError, match="max_new_tokens 99 where"):
        merge([first, odd], tmp_path / "m3")
    assert not (tmp_path / "m2").exists() and not (tmp_path / "m3").exists()


def test_smollm2_draft_recipe_trains_a_shared_draft_on_a_distill_folder(whole, chat_bundle, tmp_path):
    """tools/train/smollm2_draft.py: ``train`` makes a shared draft from the target's first layers,
    trained on a distill folder's answers (held out by topic), over the answers' frequent tokens;
    ``layers`` makes an untrained one from local text. Both load as shared drafts of the target."""
    import torch
    from transformers import AutoConfig

    from specdec.commands.distill.hf import load_model
    from specdec.export import shared_draft

    tool = [sys.executable, str(ROOT / "tools/train/smollm2_draft.py")]
    target = load_model(chat_bundle[0])
    for cmd, out, extra in (("train", tmp_path / "trained", ["--data", str(whole[0]), "--minutes", "0.05", "--tokens-per-batch", "256"]),
                            ("layers", tmp_path / "layers", [])):  # fmt: skip
        run = subprocess.run([*tool, cmd, "--target", str(chat_bundle[0]), "--layers", "1", "--vocab", "48", "--out", str(out), *extra],
                             capture_output=True, text=True, cwd=ROOT, timeout=600)  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        draft = shared_draft.load(out, AutoConfig.from_pretrained(str(out)), target)
        assert draft.config.num_hidden_layers == 1 and 48 <= len(json.loads((out / "draft_vocab.json").read_text())) <= 48 + 3
        with torch.no_grad():
            assert draft(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, target.config.vocab_size)
    record = json.loads((tmp_path / "trained" / "training.json").read_text())
    assert record["steps"] > 0 and record["held_out_conversations"] > 0 and record["log"]
