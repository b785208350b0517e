"""Tiny random thinking models for the reasoning tests, with chat templates written in the shape of the
real ones: the qwen3 of tests/golden/architectures with Qwen3's template (`<think>`/`</think>` tokens of
their own, `enable_thinking`, the reasoning of the turn after the last question kept, Hermes tool
calls), and the qwen2 with DeepSeek-R1's (the prompt opens the thinking, the markers are plain text
the tokenizer spells in several tokens, earlier turns' thinking dropped).
"""

from __future__ import annotations

from pathlib import Path

from tests.template_models import chat_model

QWEN3_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Answer with <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}{% if message.role == "user" %}
{%- set ns.last_query = loop.index0 %}{% endif %}{% endfor %}
{%- for message in messages %}
{%- if message.role == "assistant" %}<|im_start|>assistant
{% if loop.index0 > ns.last_query and message.reasoning_content is string %}<think>
{{ message.reasoning_content.strip("\\n") }}
</think>

{% endif %}{{ message.content or "" }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

DEEPSEEK_R1_TEMPLATE = """{%- for message in messages %}
{%- if message.role == "user" %}<|im_start|>User: {{ message.content }}<|im_end|>
{%- elif message.role == "assistant" %}<|im_start|>Assistant: {{ (message.content or "")
    .split("</think>")[-1] }}<|im_end|>
{%- else %}<|im_start|>{{ message.role }}: {{ message.content }}<|im_end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>Assistant: <think>
{% endif %}"""


# Qwen3-Thinking-2507's shape: the prompt opens the thinking itself
QWEN3_OPENING_TEMPLATE = QWEN3_TEMPLATE.replace("{% endif %}{% endif %}", "{% else %}<think>\n{% endif %}{% endif %}")


def qwen3_thinking_model(parent: Path, opens: bool = False) -> Path:
    """`<think>` is token 376, `</think>` 377, `<tool_call>` 378, `</tool_call>` 379; with `opens`, the
    template opens the thinking (Qwen3-Thinking-2507), else the model does (Qwen3)."""
    return chat_model("qwen3", parent / ("qwen3-thinking-2507" if opens else "qwen3-thinking"),
                 QWEN3_OPENING_TEMPLATE if opens else QWEN3_TEMPLATE,
                 ("<think>", "</think>", "<tool_call>", "</tool_call>"))


def deepseek_r1_model(parent: Path) -> Path:
    return chat_model("qwen2", parent / "r1-distill", DEEPSEEK_R1_TEMPLATE)


THINK, END_THINK = 376, 377
