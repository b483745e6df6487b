"""Hostile chat templates and tokenizer folders (issue 30, area "templates/tokenizers"): nothing a template does
runs code, reads files, hangs or prints a traceback; a template that ignores the messages is refused at load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from sapo_megatron.data import render
from sapo_megatron.data.datasets import DatasetKeys
from sapo_megatron.data.loading import build_tokenizer
from sapo_megatron.data.prompts import PromptRow
from sapo_megatron.data.render import PromptRenderer
from sapo_megatron.data.tokenizer import load_tokenizer
from tests.data.chat_fixtures import QWEN_STYLE_TEMPLATE, make_chat_tokenizer
from tests.security.hostile import case, expect

AREA = "templates/tokenizers"
CHAT = DatasetKeys(apply_chat_template=True)
ROW = PromptRow(prompt="What is 12 plus 30?", ground_truth="42")
ECHO = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
"""Renders the messages, so that a template's other parts decide the class."""


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return make_chat_tokenizer(tmp_path_factory.mktemp("tok") / "tok")


def with_template(tok_dir: Path, template: str):
    tokenizer = load_tokenizer(str(tok_dir))
    tokenizer.hf.chat_template = template
    return tokenizer


def rendered(tok_dir: Path, template: str) -> str:
    return PromptRenderer(with_template(tok_dir, template), CHAT).text(ROW)


@pytest.mark.parametrize(
    ("cls", "template", "words"),
    [
        case(AREA, "{% include '/etc/passwd' %}", "CLEAR", "{% include '/etc/passwd' %}" + ECHO, "failed"),
        case(AREA, "open('/etc/passwd')", "CLEAR", "{{ open('/etc/passwd').read() }}" + ECHO, "failed"),
        case(
            AREA,
            "cycler.__init__.__globals__.os.popen",
            "CLEAR",
            "{{ cycler.__init__.__globals__.os.popen('id').read() }}" + ECHO,
            "failed",
        ),
        case(
            AREA,
            "''.__class__.__mro__ subclasses",
            "CLEAR",
            "{{ ''.__class__.__mro__[1].__subclasses__() }}" + ECHO,
            "failed",
        ),
        case(
            AREA,
            "raise_exception('...') (Qwen-style refusal)",
            "CLEAR",
            "{{ raise_exception('System role not supported') }}",
            "the chat template failed: TemplateError: System role not supported",
        ),
        case(AREA, "template syntax error", "CLEAR", "{% for m in messages %}{{ m['content'] }}", "failed"),
        case(
            AREA,
            "recursive macro",
            "CLEAR",
            "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}" + ECHO,
            "RecursionError",
        ),
        case(
            AREA,
            "template ignoring messages",
            "CLEAR",
            "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
            "does not contain the user's text",
        ),
        case(
            AREA,
            "nested range(100000) loops",
            "CLEAR",
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}" + ECHO,
            "ran longer than",
        ),
        case(
            AREA, "10 MB template output", "CLEAR", "{{ 'x' * 10000000 }}" + ECHO, "characters for one prompt"
        ),
        case(AREA, "raise_exception.__globals__", "OK", "{{ raise_exception.__globals__ }}" + ECHO, ""),
        case(
            AREA, "lipsum/joiner/namespace reprs", "OK", "{{ lipsum }}{{ joiner }}{{ namespace }}" + ECHO, ""
        ),
        case(AREA, "strftime_now", "OK", "{{ strftime_now('%Y') }}" + ECHO, ""),
    ],
)
def test_hostile_templates(tok_dir, monkeypatch, cls, template, words):
    if "range(100000)" in template:
        monkeypatch.setattr(render, "RENDER_TIME_LIMIT_S", 1.0)  # the loops would run for hours
    text = expect(cls, lambda: rendered(tok_dir, template), words)
    if cls == "OK":
        assert ROW.prompt in text and "root:" not in text
        assert "<function" not in text or "globals" not in text


def test_the_time_limit_leaves_no_alarm_behind(tok_dir, monkeypatch):
    import signal

    monkeypatch.setattr(render, "RENDER_TIME_LIMIT_S", 0.2)
    before = signal.getsignal(signal.SIGALRM)
    assert ROW.prompt in rendered(tok_dir, QWEN_STYLE_TEMPLATE)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0) and signal.getsignal(signal.SIGALRM) is before


def copy_of(tok_dir: Path, tmp_path: Path, edit=None, **config) -> Path:
    out = tmp_path / "copy"
    shutil.copytree(tok_dir, out)
    data = json.loads((out / "tokenizer_config.json").read_text())
    data.update(config)
    for key in [k for k, v in config.items() if v is None]:
        data.pop(key)
    (out / "tokenizer_config.json").write_text(json.dumps(data))
    if edit is not None:
        edit(out)
    return out


def no_template(out: Path) -> None:
    (out / "chat_template.jinja").unlink()


def empty_template(out: Path) -> None:
    (out / "chat_template.jinja").write_text("")


def outside_template(out: Path) -> None:
    (out.parent / "hostname").write_text("buildhost\n")  # as /etc/hostname: a file outside the folder
    (out / "chat_template.jinja").unlink()
    (out / "chat_template.jinja").symlink_to(out.parent / "hostname")


def malformed_config(out: Path) -> None:
    (out / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>",')


def custom_code(out: Path) -> None:
    data = json.loads((out / "tokenizer_config.json").read_text())
    data.update(auto_map={"AutoTokenizer": ["evil.EvilTokenizer", None]}, tokenizer_class="EvilTokenizer")
    (out / "tokenizer_config.json").write_text(json.dumps(data))
    (out / "evil.py").write_text("open(__file__ + '.ran', 'w').close()\n")


@pytest.mark.parametrize(
    ("cls", "edit", "config", "words"),
    [
        case(AREA, "empty template", "CLEAR", empty_template, {}, "has no chat template"),
        case(AREA, "no chat template", "CLEAR", no_template, {}, "has no chat template"),
        case(
            AREA,
            "chat_template.jinja symlink to /etc/hostname",
            "CLEAR",
            outside_template,
            {},
            "does not contain the user's text",
        ),
        case(
            AREA,
            "malformed tokenizer_config.json",
            "CLEAR",
            malformed_config,
            {},
            "tokenizer_config.json: not valid JSON",
        ),
        case(
            AREA,
            "auto_map custom tokenizer code",
            "CLEAR",
            custom_code,
            {},
            "does not run code from a model folder",
        ),
        case(AREA, "no eos_token", "CLEAR", None, {"eos_token": None}, "defines no eos token"),
        case(
            AREA, "no eos/pad tokens", "CLEAR", None, {"eos_token": None, "pad_token": None}, "no eos token"
        ),
        case(AREA, "eos token not in vocab", "OK", None, {"eos_token": "<|never_seen|>"}, ""),
    ],
)
def test_hostile_tokenizer_folders(tok_dir, tmp_path, cls, edit, config, words):
    folder = copy_of(tok_dir, tmp_path, edit, **config)
    expect(cls, lambda: PromptRenderer(load_tokenizer(str(folder)), CHAT).text(ROW), words)
    assert not (folder / "evil.py.ran").exists()


@pytest.mark.parametrize(
    ("cls", "spec", "words"),
    [
        case(AREA, "tokenizer larger than model vocab", "CLEAR", "TOK", "but the model's vocab_size is 64"),
        case(AREA, "data.tokenizer is a file", "CLEAR", "FILE", "and not a directory (give 'char'"),
        case(
            AREA,
            "char tokenizer + apply_chat_template",
            "CLEAR",
            "char",
            "the char tokenizer has no chat template",
        ),
    ],
)
def test_tokenizer_settings(tok_dir, tmp_path, cls, spec, words):
    (tmp_path / "tokenizer.json").write_text("{}")
    spec = {"TOK": str(tok_dir), "FILE": str(tmp_path / "tokenizer.json")}.get(spec, spec)
    cfg = SimpleNamespace(
        data=SimpleNamespace(tokenizer=spec), model=SimpleNamespace(arch=SimpleNamespace(vocab_size=64))
    )
    expect(cls, lambda: PromptRenderer(build_tokenizer(cfg), CHAT), words)
