"""Untrusted chat templates: a model file's template is code. Hostile ones end in a clear error — a 400
naming the template through the API — never a hang, an escape or a dead server."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

from decoding import TemplateError
from decoding.model.chat_template import ChatTemplate

from .conftest_server import REPO
from .reliability import running_server, write_tiny_gguf
from .tinymodel import CHAT_TEMPLATE

CHAT, TOKENIZE, COMPLETIONS = "/v1/chat/completions", "/tokenize", "/v1/completions"

# What each attack does when the first message's content names it; anything else renders ChatML.
ATTACKS = {
    "internals": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "shell": "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "format": "{{ '{0.__class__.__mro__}'.format(messages) }}",
    "mutation": "{{ messages.append(messages[0]) }}",
    "endless loop": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "recursive loop": "{% for m in messages recursive %}{{ loop(messages) }}{% endfor %}",
    "huge output": "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
    "huge string": "{{ 'x' * 10000000000 }}",
    "raise": "{{ raise_exception('no such role') }}",
}
HOSTILE_TEMPLATE = "{%- set attack = messages[0]['content'] -%}" + "".join(
    f"{'{%- if' if i == 0 else '{%- elif'} attack == {name!r} -%}}{body}"
    for i, (name, body) in enumerate(ATTACKS.items())
) + "{%- else -%}" + CHAT_TEMPLATE + "{%- endif -%}"


def test_the_hostile_template_renders_chatml_for_ordinary_messages():
    template = ChatTemplate(HOSTILE_TEMPLATE, {})
    text = template.render([{"role": "user", "content": "hello"}])
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_each_attack_ends_in_a_template_error(attack):
    with pytest.raises(TemplateError, match="chat template"):
        ChatTemplate(HOSTILE_TEMPLATE, {}).render([{"role": "user", "content": attack}])


@pytest.mark.slow
def test_a_gguf_with_a_hostile_template_gets_400s_and_the_server_serves_on(tmp_path):
    model = write_tiny_gguf(tmp_path / "hostile.gguf", HOSTILE_TEMPLATE)
    with running_server(["--model", str(model)]) as server:
        url = server.base_url
        health_ok = []
        stop = threading.Event()

        def probe() -> None:  # /health keeps answering while templates loop in worker threads
            while not stop.is_set():
                health_ok.append(httpx.get(f"{url}/health", timeout=30).status_code == 200)
                time.sleep(0.05)

        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        try:
            for attack in ATTACKS:
                messages = [{"role": "user", "content": attack}]
                for path, body in ((CHAT, {"messages": messages, "max_tokens": 4, "stream": True}),
                                   (TOKENIZE, {"messages": messages})):
                    response = httpx.post(f"{url}{path}", json=body, timeout=60)
                    assert response.status_code == 400, (attack, path, response.text)
                    error = response.json()["error"]
                    assert error["param"] == "messages" and "chat template" in error["message"]
                    assert "uid=" not in error["message"]  # the shell attack never ran
        finally:
            stop.set()
            prober.join()
        assert health_ok and all(health_ok)
        ordinary = httpx.post(f"{url}{CHAT}", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                                       "ignore_eos": True},  # a sampled EOS would end it early
                              timeout=60)
        assert ordinary.status_code == 200 and ordinary.json()["choices"][0]["finish_reason"] == "length"
        assert httpx.post(f"{url}{COMPLETIONS}", json={"prompt": "hi", "max_tokens": 4}, timeout=60).status_code == 200
        assert server.process.poll() is None and "Traceback" not in server.log()


# ---- single C-level operations that the deadline cannot interrupt: each is size-checked before it runs --
# Each runs in a child process under a 2 GiB address-space limit and a 20 s timeout, so the test run is
# never at risk: an unchecked operation would die of MemoryError or time out instead of being refused.
# (Big-int arithmetic, ~40 s in one call that holds the GIL, is bounded: tests/test_chat_template.py.)

UNBOUNDED = {
    # gigabytes in one C call: without the rlimit below these are real allocations in the server
    "center filter": "{{ 'x' | center(3000000000) }}",
    "format width": "{{ '%3000000000s' % 'x' }}",
    "join of a repeated list": "{{ ([('x' * 1000000)] * 3000) | join }}",
    "replace": "{{ ('x' * 1000000) | replace('x', 'y' * 3000) }}",
    "str.replace": "{{ ('x' * 1000000).replace('x', 'y' * 3000) }}",
    "str.format width": "{{ '{:>3000000000}'.format('x') }}",
    "ljust": "{{ 'x'.ljust(3000000000) }}",
    "indent": "{{ ('x\n' * 1000000) | indent(3000) }}",
    "format filter": "{{ '%3000000000s' | format('x') }}",
    "join method": "{{ ''.join([('x' * 1000000)] * 3000) }}",
}


# Found after those were bounded: still gigabytes (MemoryError under the 2 GiB limit) before any check.
# (A string doubled with ~ or + in a loop also outgrows the caps between two deadline checks, but
# whether it reaches 2 GiB before the deadline depends on the machine's speed: no test here.)
STILL_UNBOUNDED = {
    "tojson indent": "{{ messages | tojson(indent=3000000000) }}",
    "expandtabs": "{{ ('\t' * 1000000).expandtabs(3000) }}",
    "batch fill": "{{ [1] | batch(3000000000, 'x') | list | length }}",
}


@pytest.mark.parametrize("source", list(UNBOUNDED.values()), ids=list(UNBOUNDED))
def test_single_c_operations_are_bounded_too(source):
    assert_refused_by_a_bound(source)


@pytest.mark.xfail(strict=True, reason="reported to the decoding owner with these reproducers")
@pytest.mark.parametrize("source", list(STILL_UNBOUNDED.values()), ids=list(STILL_UNBOUNDED))
def test_growth_between_checks_and_other_amplifiers_are_bounded_too(source):
    assert_refused_by_a_bound(source)


def assert_refused_by_a_bound(source: str) -> None:
    program = textwrap.dedent(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
        from decoding import TemplateError
        from decoding.model.chat_template import ChatTemplate
        try:
            ChatTemplate({source!r}, {{}}).render([])
        except TemplateError as exc:
            print("refused:", exc)
            sys.exit(0 if "MemoryError" not in str(exc) else 3)  # refused by a bound, not by running out
        sys.exit(4)
    """)
    try:
        result = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True,
                                timeout=20, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("still computing after 20 s: the render deadline (1 s) did not stop it")
    assert result.returncode == 0, result.stdout + result.stderr
