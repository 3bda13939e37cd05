"""`fastgen generate`: prints what `LLM.generate` produces, streamed or not, raw or chat."""

from __future__ import annotations

import io
import shutil

import pytest
from transformers import AutoTokenizer

from fastgen import LLM, SamplingParams
from fastgen.cli.main import main
from tests.cli.conftest import CPU_FLAGS

PROMPT = "The quick brown fox"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _llm(model: str) -> LLM:
    return LLM(model, device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20)


def _greedy_text(model: str, prompt, max_tokens: int = 12) -> str:
    return _llm(model).generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))[0].text


@pytest.fixture(scope="module")
def expected_text(tiny_models) -> str:
    text = _greedy_text(tiny_models["qwen3"], PROMPT)
    assert text, "the tiny model should generate some text"
    return text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_generate_prints_the_greedy_completion(fastgen_cli, tiny_models, expected_text, stream):
    result = fastgen_cli("generate", "--model", tiny_models["qwen3"], *CPU_FLAGS, "--max-tokens", "12",
                         "--temperature", "0", *(["--stream"] if stream else []), PROMPT)
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected_text + "\n"


def test_generate_reads_the_prompt_from_stdin(capsys, monkeypatch, tiny_models, expected_text):
    monkeypatch.setattr("sys.stdin", io.StringIO(PROMPT))
    assert main(["generate", "--model", tiny_models["qwen3"], *CPU_FLAGS, "--max-tokens", "12", "-"]) == 0
    assert capsys.readouterr().out == expected_text + "\n"


def test_generate_without_model_uses_the_default_model(capsys, monkeypatch, tiny_models, expected_text):
    # The real default model needs a ~270 MB conversion; tests/test_default_model.py covers it.
    monkeypatch.setattr("fastgen.models.default_model.default_model_path", lambda: tiny_models["qwen3"])
    assert main(["generate", *CPU_FLAGS, "--max-tokens", "12", PROMPT]) == 0
    assert capsys.readouterr().out == expected_text + "\n"


def test_generate_several_prompts_prints_each_under_a_header(capsys, tiny_models, expected_text):
    other = "Prefix caching shares"
    assert main(["generate", "--model", tiny_models["qwen3"], *CPU_FLAGS, "--max-tokens", "12", "--stats",
                 PROMPT, other]) == 0
    captured = capsys.readouterr()
    other_text = _greedy_text(tiny_models["qwen3"], other)
    assert captured.out == f"=== 1/2 ===\n{expected_text}\n=== 2/2 ===\n{other_text}\n"
    assert captured.err.count("generated tokens") == 2


def test_generate_chat_applies_the_chat_template(capsys, tiny_models, tmp_path):
    model = tmp_path / "chat-model"
    shutil.copytree(tiny_models["llama"], model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(model)

    assert main(["generate", "--model", str(model), *CPU_FLAGS, "--chat", "--system", "Be brief.",
                 "--max-tokens", "8", "--stats", "Hello"]) == 0
    captured = capsys.readouterr()
    rendered = "<|system|>Be brief.\n<|user|>Hello\n<|assistant|>"
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert captured.out == _greedy_text(str(model), ids, max_tokens=8) + "\n"
    assert f"{len(ids)} prompt + " in captured.err


def test_generate_chat_without_a_template_is_a_one_line_error(capsys, tiny_models):
    assert main(["generate", "--model", tiny_models["qwen3"], *CPU_FLAGS, "--chat", PROMPT]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastgen: error: --chat") and "Traceback" not in err


def test_generate_prompt_too_long_is_a_one_line_error(capsys, tiny_models):
    assert main(["generate", "--model", tiny_models["qwen3"], *CPU_FLAGS, "--max-model-len", "8",
                 "--max-tokens", "12", PROMPT]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastgen: error: ") and "max_model_len=8" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("argv, flag", [
    (["--top-p", "0", PROMPT], "--top-p"),
    (["--top-k", "0", PROMPT], "--top-k"),
    (["--max-tokens", "0", PROMPT], "--max-tokens"),
    (["--temperature", "-1", PROMPT], "--temperature"),
    (["--stream", PROMPT, PROMPT], "--stream"),
    (["--system", "hi", PROMPT], "--system"),
    (["--n", "0", PROMPT], "--n"),
    (["--n", "2", "--stream", PROMPT], "--stream"),
    (["--presence-penalty", "x", PROMPT], "--presence-penalty"),
    (["--min-tokens", "-1", PROMPT], "--min-tokens"),
    (["--model-preset", "qwen3-0.6b", PROMPT], "--model-preset"),
    (["--load-format", "dummy", PROMPT], "--load-format"),
    (["--model", "/no/such/folder", PROMPT], "--model"),
    (["--model", "no-such-org/no-such-model", PROMPT], "--model"),
])
def test_bad_generate_flags_exit_2_naming_the_flag(capsys, private_cache, argv, flag):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", *argv])
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err.strip().splitlines()[-1]


def test_generate_help_names_the_key_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--chat", "--stream", "--max-tokens", "--temperature", "--top-p", "--top-k", "--model",
                 "--max-model-len", "(default: 128)", "examples:"):
        assert flag in out
    # Random weights have no tokenizer and so cannot generate text: not offered here.
    assert "--model-preset" not in out and "--load-format" not in out


def test_generate_prints_every_completion_with_the_sampling_flags(capsys, tiny_models):
    model = tiny_models["qwen3"]
    assert main(["generate", "--model", model, *CPU_FLAGS, "--max-tokens", "10", "--temperature", "1",
                 "--n", "2", "--seed", "5", "--presence-penalty", "0.5", "--frequency-penalty", "0.2",
                 "--repetition-penalty", "1.2", "--min-tokens", "3", "--min-p", "0.05", PROMPT]) == 0
    params = SamplingParams(temperature=1.0, max_tokens=10, n=2, presence_penalty=0.5,
                            frequency_penalty=0.2, repetition_penalty=1.2, min_tokens=3, min_p=0.05)
    llm = LLM(model, device="cpu", dtype="float32", kv_cache_memory_bytes=16 << 20, seed=5)  # the engine's --seed
    (expected,) = llm.generate(PROMPT, params)
    texts = [c.text for c in expected.outputs]
    assert capsys.readouterr().out == f"--- completion 1/2 ---\n{texts[0]}\n--- completion 2/2 ---\n{texts[1]}\n"


def test_generate_out_of_range_penalty_is_a_one_line_error(capsys, tiny_models):
    assert main(["generate", "--model", tiny_models["qwen3"], *CPU_FLAGS, "--presence-penalty", "3",
                 PROMPT]) == 2
    err = capsys.readouterr().err
    assert err == "fastgen: error: presence_penalty=3.0 must be in [-2, 2]\n"


def test_generate_with_an_output_shape_prints_what_the_python_api_gives(capsys, tiny_models, tmp_path):
    pytest.importorskip("xgrammar")
    model = tiny_models["qwen3"]
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    (tmp_path / "schema.json").write_text(__import__("json").dumps(schema))
    (tmp_path / "list.ebnf").write_text('root ::= "[" [0-9] ("," [0-9])? "]"')
    cases = [(["--json-schema", str(tmp_path / "schema.json")], {"json": schema}),
             (["--choice", "yes", "--choice", "no"], {"choice": ["yes", "no"]}),
             (["--regex", "[a-z]{3}"], {"regex": "[a-z]{3}"}),
             (["--grammar", str(tmp_path / "list.ebnf")], {"grammar": (tmp_path / "list.ebnf").read_text()}),
             (["--json-object"], {"json_object": True})]
    llm = _llm(model)
    for flags, spec in cases:
        assert main(["generate", "--model", model, *CPU_FLAGS, "--max-tokens", "40", *flags, PROMPT]) == 0
        params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=spec)
        assert capsys.readouterr().out == llm.generate(PROMPT, params)[0].text + "\n", flags


@pytest.mark.parametrize("argv, says", [
    (["--json-schema", "/no/such.json", PROMPT], "argument --json-schema: invalid value '/no/such.json': no such file"),
    (["--regex", "a", "--choice", "b", PROMPT], "argument --choice: not allowed with argument --regex"),
])
def test_bad_output_shape_flags_exit_2(capsys, tiny_models, argv, says):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", tiny_models["qwen3"], *CPU_FLAGS, *argv])
    assert exit_info.value.code == 2 and says in capsys.readouterr().err


def test_a_schema_that_cannot_be_compiled_is_a_one_line_error(capsys, tiny_models, tmp_path):
    pytest.importorskip("xgrammar")
    (tmp_path / "bad.json").write_text('{"type": "bogus"}')
    assert main(["generate", "--model", tiny_models["qwen3"], *CPU_FLAGS, "--json-schema", str(tmp_path / "bad.json"),
                 PROMPT]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fastgen: error: structured_outputs.json cannot be compiled:") and err.count("\n") == 1
