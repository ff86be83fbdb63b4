"""``specdec generate`` run as a user would: text to stdout, stats to stderr, JSON, exit 2 on bad input."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from test_cli import run  # noqa: E402

from specdec.runtime import SpeculativeDecoder  # noqa: E402


def test_generate_json_matches_the_api(llama_bundle):
    out = llama_bundle[2]
    res = run("generate", str(out), "--prompt-ids", "5,17,42", "--max-new-tokens", "12", "--ignore-eos", "--json")
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    dec = SpeculativeDecoder.load(out)
    ref = dec.generate([5, 17, 42], max_new_tokens=12, ignore_eos=True)
    assert got["tokens"] == ref.tokens and got["text"] == ref.text
    assert got["stats"]["new_tokens"] == 12 and got["stats"]["gamma"] == 4
    pen = dict(repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=0.5, min_p=0.1)
    res = run("generate", str(out), "--prompt-ids", "5,17,42", "--max-new-tokens", "12", "--ignore-eos", "--json",
              *[x for k, v in pen.items() for x in (f"--{k.replace('_', '-')}", str(v))])  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["tokens"] == dec.generate([5, 17, 42], max_new_tokens=12, ignore_eos=True, **pen).tokens != ref.tokens


def test_generate_num_beams_prints_the_beam_search(llama_bundle):
    """--num-beams: the decoder's beam_search (plain unless --gamma), one line per sequence, or JSON."""
    out = llama_bundle[2]
    dec = SpeculativeDecoder.load(out)
    ref = dec.beam_search([5, 17, 42], num_beams=3, num_return_sequences=2, max_new_tokens=10, length_penalty=0.5, ignore_eos=True)
    args = ("generate", str(out), "--prompt-ids", "5,17,42", "--max-new-tokens", "10", "--ignore-eos", "--num-beams", "3", "--num-return-sequences", "2",
            "--length-penalty", "0.5")  # fmt: skip
    res = run(*args, "--json")
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert [s["tokens"] for s in got["sequences"]] == [b.tokens for b in ref.sequences] and got["stats"]["rounds"] == got["stats"]["steps"]
    spec = run(*args, "--json", "--gamma", "2", "--draft-width", "6")
    assert [s["tokens"] for s in json.loads(spec.stdout)["sequences"]] == [b.tokens for b in ref.sequences]
    res = run(*args)
    assert res.stdout == "".join(b.text + "\n" for b in ref.sequences) and "2 of 3 beams" in res.stderr


def test_generate_text_streams_to_stdout_and_stats_to_stderr(llama_bundle):
    out = llama_bundle[2]
    kw = ["--max-new-tokens", "16", "--temperature", "0.8", "--top-k", "40", "--seed", "3", "--gamma", "2", "--ignore-eos"]
    res = run("generate", str(out), "--prompt", "def add(a, b):", *kw)
    assert res.returncode == 0, res.stderr
    ref = SpeculativeDecoder.load(out).generate("def add(a, b):", max_new_tokens=16, temperature=0.8, top_k=40, seed=3, gamma=2, ignore_eos=True)
    assert res.stdout == ref.text + "\n"
    assert "16 tokens" in res.stderr and "gamma=2" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--prompt-ids", "1,2,x"], "expected comma-separated integers"),
        (["--prompt-ids", "999"], "999 is outside the vocabulary"),
        (["--prompt-ids", "1", "--temperature", "-1"], "temperature=-1"),
        (["--prompt-ids", "1", "--top-p", "0"], "top_p=0"),
        (["--prompt-ids", "1", "--top-k", "-2"], "top_k=-2"),
        (["--prompt-ids", "1", "--presence-penalty", "3"], "presence_penalty=3"),
        (["--prompt-ids", "1", "--min-p", "2"], "min_p=2"),
        (["--prompt-ids", "1", "--gamma", "7"], "gamma must be 0..4"),
        (["--prompt-ids", "1", "--max-new-tokens", "500"], "exceeds max-seq-len"),
        (["--prompt", "a", "--prompt-ids", "1"], "exactly one of"),
        ([], "exactly one of"),
        (["--prompt-ids", "1", "--provider", "cuda"], "onnxruntime lacks"),
        (["--prompt-ids", "1", "--provider", "cuda-graph"], "onnxruntime lacks"),
        (["--prompt-ids", "1", "--drafter", "model", "--draft-provider", "cuda"], "onnxruntime lacks"),
        (["--prompt-ids", "1", "--num-beams", "3", "--temperature", "0.7"], "--temperature 0.7: beam search is deterministic"),
        (["--prompt-ids", "1", "--num-beams", "3", "--drafter", "lookup"], "--drafter lookup: beam search"),
        (["--prompt-ids", "1", "--num-beams", "3", "--gamma", "auto"], "--gamma auto: beam search takes a fixed number"),
        (["--prompt-ids", "1", "--num-beams", "2", "--num-return-sequences", "3", "--max-new-tokens", "8"], "num_return_sequences=3"),
        (["--prompt-ids", "1", "--num-beams", "2", "--gamma", "9", "--max-new-tokens", "8"], "gamma=9"),
    ],
)
def test_generate_bad_input_exits_2_with_one_line(llama_bundle, args, msg):
    import onnxruntime as ort

    if any(a.startswith("cuda") for a in args) and "CUDAExecutionProvider" in ort.get_available_providers():  # --provider, --draft-provider
        pytest.skip("this machine has CUDA, so the provider is not refused")
    res = run("generate", str(llama_bundle[2]), *args)
    assert res.returncode == 2 and res.stdout == ""
    assert msg in res.stderr and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr


def test_generate_missing_bundle(tmp_path):
    res = run("generate", str(tmp_path / "nope"), "--prompt-ids", "1")
    assert res.returncode == 2 and "is not a folder" in res.stderr


def test_generate_holds_the_output_to_a_schema_regex_choice_or_grammar(llama_bundle, tmp_path):
    """--json-schema / --regex / --choice / --grammar: the decoder's constrained output, as the
    API gives it; a bad or doubled constraint exits 2 with one line."""
    out = llama_bundle[2]
    dec = SpeculativeDecoder.load(out)
    schema = {"type": "object", "properties": {"k": {"enum": ["a", "bc"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["k", "n"], "additionalProperties": False}  # fmt: skip
    (tmp_path / "s.json").write_text(json.dumps(schema))
    (tmp_path / "g.lark").write_text('start: "x" /[0-9]{1,3}/ | "yes"')
    (tmp_path / "g.gbnf").write_text('root ::= "n" [0-9] [0-9]?')
    cases = [(["--json-schema", str(tmp_path / "s.json")], {"json": schema}), (["--regex", "[a-z]{2,4}-[0-9]"], {"regex": "[a-z]{2,4}-[0-9]"}),
             (["--choice", "def", "--choice", "class"], {"choice": ["def", "class"]}),
             (["--grammar", str(tmp_path / "g.lark")], {"grammar": 'start: "x" /[0-9]{1,3}/ | "yes"'}),
             (["--grammar", str(tmp_path / "g.gbnf")], {"grammar": 'root ::= "n" [0-9] [0-9]?'})]  # fmt: skip
    for flags, spec in cases:
        res = run("generate", str(out), "--prompt-ids", "5,17,42", "--max-new-tokens", "40", "--json", *flags)
        assert res.returncode == 0, res.stderr
        got = json.loads(res.stdout)
        assert got["tokens"] == dec.generate([5, 17, 42], max_new_tokens=40, structured_outputs=spec).tokens
        assert got["stats"]["finish_reason"] == "eos", (flags, got)
    text = json.loads(run("generate", str(out), "--prompt-ids", "5,17,42", "--max-new-tokens", "40", "--json", *cases[0][0]).stdout)["text"]
    assert json.loads(text)["k"] in ("a", "bc")
    for flags, words in ((["--regex", "("], "regex"), (["--regex", "a", "--choice", "b"], "one constraint"),
                         (["--json-schema", str(tmp_path / "g.lark")], "not a JSON file")):  # fmt: skip
        res = run("generate", str(out), "--prompt-ids", "5,17,42", "--max-new-tokens", "20", *flags)
        assert res.returncode == 2 and words in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
