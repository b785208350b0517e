import time

import pytest

from decoding import TemplateError
from decoding.model.chat_template import ChatTemplate


def render(source: str, messages=None, **extra) -> str:
    template = ChatTemplate(source, {"bos_token": "<s>", "eos_token": "</s>"})
    return template.render(messages or [{"role": "user", "content": "hi"}], **extra)


def test_default_model_template_renders_the_chatml_turns(default_model):
    text = default_model.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    )
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"


def test_trim_and_lstrip_blocks_follow_transformers():
    # lstrip_blocks eats the indentation before a block tag, trim_blocks the newline after one
    source = "{% for m in messages %}\n    {% if m.content %}{{ m.content }}{% endif %}\n{% endfor %}"
    assert render(source, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "ab"


def test_special_tokens_and_generation_flag_are_visible():
    source = "{{ bos_token }}{% if add_generation_prompt %}GEN{% endif %}{{ eos_token }}"
    assert render(source, add_generation_prompt=True) == "<s>GEN</s>"
    assert render(source, add_generation_prompt=False) == "<s></s>"


def test_raise_exception_becomes_a_template_error():
    with pytest.raises(TemplateError, match="roles must alternate"):
        render("{{ raise_exception('roles must alternate') }}")


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{% set x = messages.append(1) %}",
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    ],
)
def test_access_to_python_internals_is_refused(source):
    with pytest.raises(TemplateError):
        render(source)


def test_an_endless_loop_is_stopped_by_the_deadline():
    source = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    start = time.monotonic()
    with pytest.raises(TemplateError, match="longer than"):
        render(source)
    assert time.monotonic() - start < 30  # bounded, not a speed assertion: without the deadline it runs for hours


def test_huge_output_and_huge_strings_are_refused():
    with pytest.raises(TemplateError):
        render("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}")
    with pytest.raises(TemplateError, match="oversized"):
        render("{{ 'x' * 10000000000 }}")


@pytest.mark.parametrize("source", [
    "{{ (((10 ** 64) ** 64) ** 64) ** 64 > 1 }}",  # ~40 s in one C call before the bound
    "{% set ns = namespace(x=10 ** 64) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
])
def test_huge_integer_arithmetic_is_refused(source):
    start = time.monotonic()
    with pytest.raises(TemplateError, match="huge"):
        render(source)
    assert time.monotonic() - start < 30  # bounded, not a speed assertion: unbounded it runs for minutes


def test_ordinary_integer_arithmetic_still_works():
    assert render("{{ 2 ** 64 }} {{ (10 ** 18) * (10 ** 18) }} {{ 3 * 'ab' }}") == f"{2**64} {10**36} ababab"


def test_recursion_is_refused():
    source = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"
    with pytest.raises(TemplateError):
        render(source)


def test_syntax_errors_are_reported_at_compile_time():
    with pytest.raises(TemplateError, match="does not compile"):
        ChatTemplate("{% for %}", {})
