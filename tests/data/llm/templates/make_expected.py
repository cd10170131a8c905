#!/usr/bin/python3
"""Renders the chat templates of this folder with Python's jinja2, in the
environment transformers builds for apply_chat_template, and writes what
chat_template_test compares the C++ renderer with, byte for byte:

  cases.json           one entry per (template, conversation): the context
                       passed to the template, and the expected output file
                       (expected/<name>.txt) or the error the render raises
  expected/*.txt       the rendered prompts
  language_cases.json  small templates exercising one language piece each,
                       with jinja2's output or error

Run from anywhere with Debian's python3-jinja2 (3.1):
  /usr/bin/python3 tests/data/llm/templates/make_expected.py
The environment below follows transformers' _compile_jinja_template
(src/transformers/utils/chat_template_utils.py): ImmutableSandboxedEnvironment
with trim_blocks=True, lstrip_blocks=True, the loopcontrols extension and a
{% generation %} tag, tojson replaced by json.dumps(ensure_ascii=False, ...),
and the globals raise_exception and strftime_now. strftime_now reads a fixed
clock (FIXED_NOW) so that the expected files do not change with the date;
the C++ test injects the same time.
"""

import datetime
import json
import os
import sys

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

HERE = os.path.dirname(os.path.abspath(__file__))
FIXED_NOW = datetime.datetime(2025, 3, 9, 14, 30, 0)


class GenerationTag(jinja2.ext.Extension):
    """transformers' AssistantTracker, inactive: {% generation %} renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(lineno)

    def _generation(self, caller):
        return caller()


def make_env():
    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        return FIXED_NOW.strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


ENV = make_env()


def render(source, context):
    """(output, None) or (None, (error type, message, raised by raise_exception))."""
    try:
        return ENV.from_string(source).render(**context), None
    except TemplateError as e:
        # raise_exception raises the TemplateError base class itself.
        return None, (type(e).__name__, str(e), type(e) is TemplateError)
    except Exception as e:  # TypeError, ValueError, ... from the template's Python
        return None, (type(e).__name__, str(e), False)


# ---- conversations

SYSTEM = {"role": "system", "content": "You are a helpful assistant.\nAnswer briefly."}
USER1 = {"role": "user", "content": "Hello, how are you?"}
ASSISTANT1 = {"role": "assistant", "content": "I'm fine, thanks. How can I help?"}
USER2 = {"role": "user", "content": "  Write \"hi\" in French \\o/ — café, 日本, 🙂  \n\n"}
ASSISTANT2 = {"role": "assistant", "content": "\n  Salut !  \n"}

CHATS = {
    "user": [USER1],
    "system_user": [SYSTEM, USER1],
    "multi_turn": [USER1, ASSISTANT1, USER2],
    "system_multi_turn": [SYSTEM, USER1, ASSISTANT1, USER2, ASSISTANT2],
    "ends_with_assistant": [USER1, ASSISTANT1],
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "Get the current weather in a given location",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "The city, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                       "required": ["tz"]},
        "return": {"type": "string"},
    },
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
WEATHER_QUESTION = {"role": "user", "content": "What's the weather like in Paris?"}
WEATHER_CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call12345", "type": "function",
     "function": {"name": "get_current_weather",
                  "arguments": {"location": "Paris", "unit": "celsius"}}}]}
WEATHER_RESULT = {"role": "tool", "tool_call_id": "call12345", "name": "get_current_weather",
                  "content": "{\"temperature\": 21, \"unit\": \"celsius\"}"}
TWO_CALLS = {"role": "assistant", "content": "Let me check both.", "tool_calls": [
    {"id": "call12345", "type": "function",
     "function": {"name": "get_current_weather", "arguments": {"location": "Paris"}}},
    {"id": "call67890", "type": "function",
     "function": {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}}]}
TIME_RESULT = {"role": "tool", "tool_call_id": "call67890", "name": "get_time",
               "content": "14:30"}
FOLLOW_UP = {"role": "assistant", "content": "It is 21°C in Paris."}

TOOL_CHAT = [SYSTEM, WEATHER_QUESTION, WEATHER_CALL, WEATHER_RESULT, FOLLOW_UP]
TWO_CALL_CHAT = [WEATHER_QUESTION, TWO_CALLS, WEATHER_RESULT, TIME_RESULT]

LLAMA2 = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
LLAMA3 = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
QWEN = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
CHATML = {"bos_token": "<s>", "eos_token": "<|im_end|>"}


def context(messages, add_generation_prompt, tokens, tools=None, **kwargs):
    """What transformers passes: messages, tools, documents, add_generation_prompt,
    then the tokenizer's special tokens and extra template kwargs."""
    ctx = {"messages": messages, "tools": tools, "documents": None,
           "add_generation_prompt": add_generation_prompt}
    ctx.update(tokens)
    ctx.update(kwargs)
    return ctx


def plain_cases(tokens, chats=CHATS):
    cases = []
    for chat_name, chat in chats.items():
        for agp in (False, True):
            cases.append(("%s%s" % (chat_name, "_gen" if agp else ""),
                          context(chat, agp, tokens)))
    return cases


def template_cases():
    alternating = CHATS
    cases = {
        "chatml": plain_cases(CHATML),
        "qwen2": plain_cases(QWEN),
        "llama3": plain_cases(LLAMA3),
        "llama2-chat": plain_cases(LLAMA2) + [
            ("error_alternation", context([USER1, USER1], False, LLAMA2)),
        ],
        "mistral-v0.1": plain_cases(LLAMA2, {k: v for k, v in alternating.items()
                                             if not k.startswith("system")}) + [
            ("error_alternation", context([USER1, ASSISTANT1, ASSISTANT1], False, LLAMA2)),
            ("error_system", context([SYSTEM, USER1], False, LLAMA2)),
            ("error_tool_role", context([USER1, {"role": "tool", "content": "x"}], False, LLAMA2)),
        ],
        "mistral-v0.2": plain_cases(LLAMA2, {k: v for k, v in alternating.items()
                                             if not k.startswith("system")}) + [
            ("error_alternation", context([USER1, USER1], True, LLAMA2)),
            ("error_system", context([SYSTEM, USER1], True, LLAMA2)),
        ],
        "mistral-nemo": plain_cases(LLAMA2) + [
            ("tools", context([WEATHER_QUESTION], False, LLAMA2, tools=TOOLS)),
            ("tool_calls", context(TOOL_CHAT, False, LLAMA2, tools=TOOLS)),
            ("two_calls", context(TWO_CALL_CHAT, False, LLAMA2, tools=[WEATHER_TOOL])),
            ("error_alternation", context([USER1, USER1], False, LLAMA2)),
            ("error_tool_call_id", context([WEATHER_QUESTION, {
                "role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "get_time", "arguments": {"tz": "UTC"}}}]}], False, LLAMA2)),
        ],
        "qwen2.5": plain_cases(QWEN) + [
            ("tools", context([WEATHER_QUESTION], True, QWEN, tools=TOOLS)),
            ("tools_system", context([SYSTEM, WEATHER_QUESTION], True, QWEN, tools=TOOLS)),
            ("tool_calls", context(TOOL_CHAT, True, QWEN, tools=TOOLS)),
            ("two_calls", context(TWO_CALL_CHAT, True, QWEN, tools=TOOLS)),
            ("string_arguments", context([WEATHER_QUESTION, {
                "role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                    "name": "get_time", "arguments": "{\"tz\": \"UTC\"}"}}]}], False, QWEN)),
        ],
        "llama3.1": plain_cases(LLAMA3) + [
            ("date_string", context([SYSTEM, USER1], True, LLAMA3, date_string="01 Jan 2025")),
            ("tools", context([SYSTEM, WEATHER_QUESTION], True, LLAMA3, tools=TOOLS)),
            ("tools_in_system", context([SYSTEM, WEATHER_QUESTION], True, LLAMA3, tools=TOOLS,
                                        tools_in_user_message=False)),
            ("tool_calls", context(TOOL_CHAT, True, LLAMA3, tools=TOOLS)),
            ("custom_tools", context([WEATHER_QUESTION], True, LLAMA3, custom_tools=[TIME_TOOL])),
            ("builtin_tools", context([SYSTEM, {"role": "user", "content": "Search for hearth"}, {
                "role": "assistant", "tool_calls": [{"type": "function", "function": {
                    "name": "brave_search", "arguments": {"query": "hearth", "count": "3"}}}]}, {
                "role": "ipython", "content": {"results": ["a", "b"]}}], True, LLAMA3,
                builtin_tools=["brave_search", "wolfram_alpha", "code_interpreter"])),
            ("error_two_calls", context(TWO_CALL_CHAT, True, LLAMA3, tools=TOOLS)),
            ("error_no_user_message", context([SYSTEM], True, LLAMA3, tools=TOOLS)),
        ],
        "llama3.2": plain_cases(LLAMA3) + [
            ("date_string", context([USER1], True, LLAMA3, date_string="26 Jul 2024")),
            ("tools", context([WEATHER_QUESTION], True, LLAMA3, tools=TOOLS)),
            ("tool_calls", context(TOOL_CHAT, True, LLAMA3, tools=TOOLS)),
            ("tool_result_string", context([WEATHER_QUESTION, WEATHER_CALL, WEATHER_RESULT], True,
                                           LLAMA3)),
            ("error_two_calls", context(TWO_CALL_CHAT, True, LLAMA3)),
        ],
    }
    return cases


# ---- language pieces: (name, template, context)

LANGUAGE = [
    # whitespace control, trim_blocks, lstrip_blocks, comments, raw
    ("ws_trim_blocks", "{% if true %}\nA\n{% endif %}\nB\n", {}),
    ("ws_lstrip_blocks", "  {% if true %}\n  X\n  {% endif %}\nY", {}),
    ("ws_lstrip_not_for_print", "  {{ 'a' }}\n  {% if 1 %}b{% endif %}", {}),
    ("ws_minus", "a   {{- 'b' -}}   c\n\n{%- if true -%}\n  d  \n{%- endif -%}\n e", {}),
    ("ws_plus", "  {%+ if true %}x{% endif +%}\ny", {}),
    ("ws_comment", "a\n  {# note #}\nb{#- x -#}  c {# y #}\nd", {}),
    ("ws_trailing_newline_dropped", "a\n", {}),
    ("ws_two_trailing_newlines", "a\n\n", {}),
    ("ws_crlf", "a\r\nb\r{% if true %}\r\nc{% endif %}\r\n", {}),
    ("raw_block", "{% raw %}{{ not }} {% evaluated %}{% endraw %}!", {}),
    ("raw_block_strip", "x  {%- raw -%}  {{ y }}  {%- endraw -%}  z", {}),
    # literals and printing
    ("print_values", "{{ none }}|{{ true }}|{{ false }}|{{ 3 }}|{{ -2.5 }}|{{ 1e16 }}|{{ 1.5e-5 }}|"
     "{{ 0.1 + 0.2 }}|{{ 1_000 }}|{{ 0x1f }}|{{ 10 / 4 }}|{{ 4 / 2 }}", {}),
    ("print_containers", "{{ [1, 'a', none, true, 2.0, {'k': \"it's\"}] }}|{{ (1,) }}|{{ (1, 'b') }}"
     "|{{ {} }}|{{ [] }}|{{ ['a\\nb', 'q\"'] }}", {}),
    ("string_escapes", "{{ 'tab\\there' }}|{{ \"nl\\nx\" }}|{{ '\\x41\\u00e9\\U0001F642' }}|"
     "{{ 'back\\\\slash' }}|{{ 'q\\'s' }}|{{ 'oct\\101' }}|{{ 'keep\\d' }}", {}),
    ("string_concat_literals", "{{ 'a' 'b' \"c\" }}", {}),
    ("undefined_prints_empty", "[{{ missing }}][{{ d.missing }}][{{ n.x }}][{{ n['x'] }}]",
     {"d": {}, "n": None}),
    ("undefined_behaviour", "{{ missing is defined }}{{ missing|length }}{{ missing is iterable }}"
     "{{ missing is sequence }}{{ missing is mapping }}{{ 'a' in missing }}"
     "{% for x in missing %}x{% endfor %}{{ missing == missing }}{{ missing|default('d') }}"
     "{{ not missing }}{{ missing ~ 'c' }}{{ missing is none }}", {}),
    # operators
    ("arithmetic", "{{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 % -3 }} {{ 2 ** 10 }} {{ 2 ** -1 }}"
     " {{ -3 // 2.0 }} {{ -3 % 2.0 }} {{ 1 + 2.5 }} {{ 'ab' * 3 }} {{ [1] * 2 }} {{ 3 - -1 }}"
     " {{ +4 }} {{ -(1) }} {{ true + 1 }}", {}),
    ("precedence", "{{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 2 ** 3 ** 2 }} {{ 'a' ~ 2 * 3 }}"
     " {{ -2 ** 2 }} {{ not 1 == 2 }} {{ 1 if 0 else 2 if 0 else 3 }}", {}),
    ("comparisons", "{{ 1 < 2 < 3 }}{{ 3 > 2 > 2 }}{{ 1 == 1.0 }}{{ true == 1 }}{{ 'a' < 'b' }}"
     "{{ [1, 2] < [1, 3] }}{{ [1, 2] == [1, 2] }}{{ {'a': 1, 'b': 2} == {'b': 2, 'a': 1} }}"
     "{{ 'x' != 'y' }}{{ 2 >= 2 }}{{ 1 <= 0 }}", {}),
    ("membership", "{{ 'a' in 'cat' }}{{ 'x' not in ['x'] }}{{ 'k' in {'k': 1} }}{{ 2 in [1, 2] }}"
     "{{ 'tool_calls' in m }}{{ 'role' in m }}", {"m": {"role": "user"}}),
    ("logic", "{{ 1 and 'x' }}|{{ 0 or [] }}|{{ none or 'd' }}|{{ '' and 1 }}|{{ not [] }}", {}),
    ("concat", "{{ 'a' ~ 1 ~ none ~ true ~ 2.5 ~ [1] }}", {}),
    ("conditional_expr", "{{ 'y' if 1 else 'n' }}|{{ 'y' if 0 }}|{{ ('a' if true else 'b')|upper }}", {}),
    # subscripts
    ("subscripts", "{{ l[0] }}{{ l[-1] }}{{ l[1:] }}{{ l[::-1] }}{{ l[:-1] }}{{ l[1:3] }}{{ l[::2] }}"
     "{{ s[1] }}{{ s[1:3] }}{{ s[::-1] }}{{ s[-2:] }}{{ d['k'] }}{{ d.k }}{{ l.0 }}{{ l[9] }}",
     {"l": [1, 2, 3, 4], "s": "héllo", "d": {"k": "v"}}),
    # statements
    ("for_loop_vars", "{% for x in items %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}"
     "{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}"
     "{{ loop.previtem }}|{{ loop.nextitem }};{% endfor %}", {"items": ["a", "b", "c"]}),
    ("for_else_filter", "{% for x in [] %}a{% else %}empty{% endfor %}|{% for x in [1, 2, 3, 4] if x is even %}"
     "{{ x }}{{ loop.length }}{% else %}none{% endfor %}", {}),
    ("for_unpack_dict", "{% for k, v in d|items %}{{ k }}={{ v }};{% endfor %}{% for k in d %}{{ k }}{% endfor %}"
     "{% for k, v in d.items() %}{{ k }}{% endfor %}", {"d": {"z": 1, "a": 2}}),
    ("for_string", "{% for c in 'héy' %}[{{ c }}]{% endfor %}", {}),
    ("for_nested_loop", "{% for a in [1, 2] %}{% for b in 'xy' %}{{ loop.index }}{{ b }}{% endfor %}"
     "{{ loop.index }};{% endfor %}", {}),
    ("loop_controls", "{% for i in range(6) %}{% if i == 1 %}{% continue %}{% endif %}"
     "{% if i == 4 %}{% break %}{% endif %}{{ i }}{% endfor %}", {}),
    ("loop_cycle", "{% for i in range(5) %}{{ loop.cycle('a', 'b', 'c') }}{% endfor %}", {}),
    ("scoping_for", "{% set c = 0 %}{% for i in range(3) %}{% set c = c + 1 %}{{ c }}{% endfor %}{{ c }}"
     "{% for i in range(2) %}{{ x }}{% set x = 5 %}{{ x }}{% endfor %}{{ x }}", {"x": 1}),
    ("scoping_if", "{% if true %}{% set y = 3 %}{% endif %}{{ y }}|{% for i in [1] %}"
     "{% if true %}{% set z = 4 %}{% endif %}{{ z }}{% endfor %}[{{ z }}]", {}),
    ("namespace", "{% set ns = namespace(a=1, items=[]) %}{% for i in range(4) %}"
     "{% set ns.a = ns.a + i %}{% set ns.items = ns.items + [i] %}{% endfor %}{{ ns.a }}{{ ns.items }}"
     "{% set n2 = namespace({'k': 'v'}, x=2) %}{{ n2.k }}{{ n2.x }}{{ ns['a'] }}", {}),
    ("set_tuple_and_block", "{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set t = 1, 2 %}{{ t }}"
     "{% set blk %}  hi {{ a }} {% endset %}[{{ blk }}]{% set up | upper %}x{{ b }}{% endset %}{{ up }}", {}),
    ("macro", "{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{{ g }}{% endmacro %}"
     "{% set g = '.' %}{{ greet('a') }} {{ greet('b', '?') }} {{ greet(punct=';', name='c') }}"
     " {{ greet() }}", {}),
    ("macro_recursion", "{% macro f(n) %}{% if n > 0 %}{{ n }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
     "{{ f(5) }}", {}),
    ("with_block", "{% with a = 1, b = 2 %}{{ a }}{{ b }}{% endwith %}[{{ a }}]", {}),
    ("filter_block", "{% filter upper %}abc{{ 'd' }}{% endfilter %}", {}),
    ("generation_block", "a{% generation %}b{{ 'c' }}{% endgeneration %}d", {}),
    ("elif_chain", "{% for x in [1, 2, 3] %}{% if x == 1 %}one{% elif x == 2 %}two{% else %}many"
     "{% endif %}{% endfor %}", {}),
    # filters
    ("filter_strings", "{{ '  a b  '|trim }}|{{ 'xxaxx'|trim('x') }}|{{ 'aBc'|upper }}|{{ 'aBc'|lower }}"
     "|{{ 'hELLO wORLD'|capitalize }}|{{ 'hello wORLD-foo (bar'|title }}|{{ 'aaa'|replace('a', 'b', 2) }}"
     "|{{ 'ab'|replace('', '-') }}|{{ 5|string }}|{{ [1]|string }}|{{ 'héllo'|length }}"
     "|{{ 'abc'|reverse }}|{{ '<a&b>'|e }}|{{ 'x'|safe }}|{{ 'one two  three'|wordcount }}", {}),
    ("filter_tojson", "{{ d|tojson }}|{{ d|tojson(indent=2) }}|{{ d|tojson(indent=4, sort_keys=true) }}"
     "|{{ d|tojson(separators=(',', ':')) }}|{{ 'é\"\\n\\t\\u0001'|tojson }}|{{ 'é'|tojson(ensure_ascii=true) }}"
     "|{{ [1.0, 2.5, -0.0, 1e20, true, none]|tojson }}|{{ []|tojson(indent=2) }}|{{ {}|tojson }}"
     "|{{ (1, 2)|tojson }}|{{ d|tojson(indent='\\t') }}",
     {"d": {"b": 1, "a": [1, {"c": None}], "é": "ü"}}),
    ("filter_sequences", "{{ l|first }}{{ l|last }}{{ l|length }}{{ l|join(',') }}{{ l|join }}"
     "{{ l|sort }}{{ l|sort(reverse=true) }}{{ l|unique|list }}{{ l|reverse|list }}{{ l|min }}{{ l|max }}"
     "{{ l|sum }}{{ []|first }}{{ {'x': 1}|first }}{{ 'ab'|list }}{{ l|count }}",
     {"l": [3, 1, 2, 3]}),
    ("filter_sort_strings", "{{ ['b', 'A', 'a', 'C']|sort }}{{ ['b', 'A', 'a']|sort(case_sensitive=true) }}"
     "{{ ['a', 'A', 'b']|unique|list }}{{ ['b', 'A']|min }}{{ {'b': 1, 'A': 2}|dictsort }}"
     "{{ {'b': 1, 'A': 2}|dictsort(by='value', reverse=true) }}", {}),
    ("filter_select_map", "{{ ms|selectattr('role', 'equalto', 'user')|list }}"
     "{{ ms|rejectattr('role', 'equalto', 'user')|map(attribute='content')|list }}"
     "{{ [1, 2, 3, 4]|select('odd')|list }}{{ [1, 2, 3, 4]|reject('even')|list }}"
     "{{ [0, 1, '', 'a']|select|list }}{{ ['a', 'B']|map('upper')|join('-') }}"
     "{{ ms|map(attribute='name', default='?')|list }}{{ ms|selectattr('name')|list }}"
     "{{ ['x', 'code_interpreter', 'y']|reject('equalto', 'code_interpreter')|join(', ') }}"
     "{{ ms|map(attribute='content')|map('length')|sum }}{{ ms|sort(attribute='content')|map(attribute='role')|list }}"
     "{{ ms|join(', ', attribute='role') }}{{ ms|sum(attribute='n', start=10) }}",
     {"ms": [{"role": "user", "content": "hi", "n": 1}, {"role": "assistant", "content": "yo", "name": "b", "n": 2},
             {"role": "user", "content": "bye", "n": 3}]}),
    ("filter_select_map_false_values", "{{ none|selectattr('type', 'equalto', 'x')|list }}"
     "{{ ''|map('upper')|list }}{{ 0|select|list }}{{ []|rejectattr('a')|list }}{{ missing|map(attribute='a')|list }}"
     "{{ tools|selectattr('type', 'equalto', 'code_interpreter')|list|length > 0 }}", {"tools": None}),
    ("filter_items_default", "{{ d|items|list }}{{ missing|items|list }}{{ missing|default('x') }}"
     "{{ ''|default('x') }}{{ ''|default('x', true) }}{{ none|default('x') }}{{ 0|d(5, true) }}",
     {"d": {"a": 1}}),
    ("filter_numbers", "{{ '42'|int }}{{ '4.7'|int }}{{ 'x'|int }}{{ 'x'|int(7) }}{{ 3.9|int }}{{ '0x1A'|int(0, 16) }}"
     "{{ '12'|int(base=8) }}{{ '1e3'|float }}{{ 'x'|float }}{{ 3|float }}{{ -3|abs }}{{ -2.5|abs }}"
     "{{ 2.5|round }}{{ 3.5|round }}{{ 3.14159|round(2) }}{{ 2.7|round(0, 'floor') }}{{ 2.1|round(0, 'ceil') }}"
     "{{ true|int }}{{ ' 7 '|int }}", {}),
    ("filter_indent", "[{{ 'a\\nb\\n\\nc'|indent }}][{{ 'a\\nb'|indent(2, true) }}]"
     "[{{ 'a\\n\\nb'|indent(2, blank=true) }}][{{ 'a\\nb'|indent('> ') }}]", {}),
    ("filter_chain_precedence", "{{ 'a' ~ ' b '|trim ~ 'c' }}|{{ -3|abs }}|{{ [3, 1]|sort|first + 1 }}"
     "|{{ 'x' + m.content|trim + 'y' }}", {"m": {"content": "  mid  "}}),
    ("markup", "{{ 'a<'|safe + '<b\"' }}|{{ '<x>' + 'y'|safe }}|{{ 'a'|safe ~ '<' ~ 1 }}|{{ ('<'|safe) * 2 + '<' }}"
     "|{{ ['<'|safe] }}|{{ '<'|e }}{{ '<'|e|e }}|{{ ('<a>'|safe)|upper + '>' }}|{{ ('<a> '|safe)|trim + '<' }}"
     "|{{ ('x'|safe)|string + '<' }}|{{ ('x'|safe).upper() + '<' }}|{{ ('x'|safe)|replace('x', '<') + '<' }}"
     "|{{ ('x'|safe)|join + '<' }}|{{ ['a'|safe, '<']|join('&') }}|{{ ('\"'|safe)|tojson }}|{{ 'a'|safe is string }}"
     "|{{ ('x'|safe)|indent + '<' }}|{{ ('a'|safe)|first + '<' }}|{{ ('a<b'|safe)[1:] + '<' }}"
     "|{{ ('a b'|safe).split()[0] + '<' }}|{{ ('x'|safe).replace('x', '<') }}|{{ 5|safe + '<' }}"
     "|{{ \"Use '\"|safe + t.name + \"'\\n\"|safe + t|tojson }}", {"t": {"name": "f<", "d": "\"q\""}}),
    ("error_markup_plus_int", "{{ 'x'|safe + 1 }}", {}),
    # tests
    ("tests", "{{ 'a' is string }}{{ 1 is number }}{{ true is number }}{{ true is integer }}"
     "{{ 1.0 is float }}{{ {} is mapping }}{{ 'x' is iterable }}{{ 1 is iterable }}{{ 'x' is sequence }}"
     "{{ none is none }}{{ 1 is boolean }}{{ false is false }}{{ 0 is false }}{{ true is true }}"
     "{{ 3 is odd }}{{ 4 is even }}{{ 9 is divisibleby 3 }}{{ 'a' is eq 'a' }}{{ 2 is gt 1 }}"
     "{{ 1 is lessthan 0 }}{{ 1 is in [1] }}{{ 'ab' is lower }}{{ 'AB' is upper }}{{ x is not defined }}"
     "{{ range is callable }}{{ 1 is sameas 1 }}{{ 'upper' is filter }}{{ 'odd' is test }}"
     "{{ [] is iterable }}{{ 1 is ne 2 }}{{ 2 is ge 2 }}{{ 1 is le 0 }}{{ 2 is equalto 2 }}", {}),
    # methods
    ("methods_str", "{{ ' a b '.strip() }}|{{ 'xxaxx'.strip('x') }}|{{ 'abc'.lstrip('a') }}|{{ 'abc'.rstrip('c') }}"
     "|{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|{{ 'a b c'.split(none, 1) }}|{{ 'a b c'.rsplit(' ', 1) }}"
     "|{{ '  a b c '.rsplit(none, 1) }}|{{ 'a\\nb\\r\\nc'.splitlines() }}|{{ 'abc'.startswith('ab') }}"
     "|{{ 'abc'.startswith(('x', 'a')) }}|{{ 'abc'.endswith('bc') }}|{{ 'Hi There'.lower() }}|{{ 'hi'.upper() }}"
     "|{{ 'hello wORLD 1st'.title() }}|{{ 'hELLO'.capitalize() }}|{{ 'aaa'.replace('a', 'b') }}"
     "|{{ 'aaa'.replace('a', 'b', 1) }}|{{ 'héllo'.find('l') }}|{{ 'abc'.find('z') }}|{{ 'aXbX'.count('X') }}"
     "|{{ '-'.join(['a', 'b']) }}|{{ '12'.isdigit() }}|{{ 'ab'.isalpha() }}|{{ ' '.isspace() }}"
     "|{{ 'x</think>y'.split('</think>')[-1] }}|{{ 'abc'.rfind('c') }}", {}),
    ("methods_dict", "{{ d.get('a') }}|{{ d.get('zz') }}|{{ d.get('zz', 5) }}|{{ d.keys()|list }}"
     "|{{ d.values()|list }}|{{ d.items()|list }}|{% for k, v in d.items() %}{{ k }}{{ v }}{% endfor %}",
     {"d": {"a": 1, "b": [2]}}),
    ("methods_list", "{{ l.count(2) }}{{ l.index(2) }}{{ t.count('a') }}", {"l": [1, 2, 2], "t": ["a"]}),
    ("filter_round_int", "{{ 5|round }}{{ 1250|round(-2) }}{{ 1350|round(-2) }}{{ -1250|round(-2) }}"
     "{{ true|round }}{{ 7|round(1) }}", {}),
    ("globals", "{{ range(3)|list }}{{ range(1, 10, 3)|list }}{{ range(3, 0, -1)|list }}"
     "{{ dict(a=1, b=2) }}{{ dict({'z': 1}, y=2) }}{{ strftime_now('%d %b %Y %H:%M') }}"
     "{{ strftime_now is defined }}{{ raise_exception is defined }}{{ namespace is defined }}", {}),
    ("context_shadows_global", "{{ range }}", {"range": "mine"}),
    # errors, compared with jinja2's message
    ("error_raise", "{{ raise_exception('Roles must alternate!') }}", {}),
    ("error_raise_in_loop", "{% for m in ms %}{% if m == 2 %}{{ raise_exception('bad item ' ~ m) }}"
     "{% endif %}{{ m }}{% endfor %}", {"ms": [1, 2, 3]}),
    ("error_undefined_attr", "{{ missing.attr }}", {}),
    ("error_undefined_add", "{{ missing + 1 }}", {}),
    ("error_dict_attr_chain", "{{ d.x.y }}", {"d": {}}),
    ("error_str_plus_int", "{{ 'a' + 1 }}", {}),
    ("error_int_plus_str", "{{ 1 + 'a' }}", {}),
    ("error_list_plus_str", "{{ [1] + 'a' }}", {}),
    ("error_compare", "{{ 1 < 'a' }}", {}),
    ("error_none_iter", "{% for x in none %}{% endfor %}", {}),
    ("error_int_iter", "{% for x in 3 %}{% endfor %}", {}),
    ("error_in_string", "{{ 1 in 'abc' }}", {}),
    ("error_in_none", "{{ 1 in none }}", {}),
    ("error_len_none", "{{ none|length }}", {}),
    ("error_tojson_undefined", "{{ missing|tojson }}", {}),
    ("error_zero_div", "{{ 1 / 0 }}", {}),
    ("error_zero_floordiv", "{{ 1 // 0 }}", {}),
    ("error_zero_mod", "{{ 1 % 0 }}", {}),
    ("error_not_callable", "{{ 5() }}", {}),
    ("error_unknown_method", "{{ 'abc'.nope() }}", {}),
    ("error_unsafe_append", "{{ [1].append(2) }}", {}),
    ("error_ns_assign", "{% set x = 1 %}{% set x.y = 1 %}", {}),
    ("error_unpack", "{% for a, b in [[1, 2], [3]] %}{{ a }}{% endfor %}", {}),
    ("error_macro_args", "{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}", {}),
    ("error_macro_kwarg", "{% macro m(a) %}{% endmacro %}{{ m(z=2) }}", {}),
    ("error_slice_step", "{{ [1, 2][::0] }}", {}),
    ("error_range_too_big", "{{ range(200000)|length }}", {}),
    ("error_unary", "{{ -'a' }}", {}),
    ("error_items_none", "{{ none|items|list }}", {}),
    ("error_str_times_str", "{{ 'a' * 'b' }}", {}),
    ("error_slice_int", "{{ i[1:] }}", {"i": 5}),
    ("error_slice_none", "{{ n[:1] }}", {"n": None}),
    ("error_slice_dict", "{{ d[1:] }}", {"d": {"a": 1}}),
    ("error_slice_index_type", "{{ l['a':] }}", {"l": [1]}),
    ("error_undefined_int", "{{ missing|int }}", {}),
    ("error_undefined_float", "{{ d.x|float }}", {"d": {}}),
    ("error_indent_int", "{{ 5|indent }}", {}),
    ("error_test_argument", "{{ 1 is none 2 }}", {}),
    ("error_list_index_missing", "{{ [1].index(3) }}", {}),
    ("error_concat_binds_tighter_than_plus", "{{ 'a' ~ 1 + 2 }}", {}),
]


def random_whitespace_cases(count, seed=20250309):
    """Templates of random text and tags with random whitespace control:
    trim_blocks, lstrip_blocks, -, + and comments meeting in every order."""
    import random
    rng = random.Random(seed)
    texts = ["", " ", "  ", "\t", "\n", " \n", "\n  ", "\n\n", "a", " b ", "c\n", "\u00a0", "\r\n",
             "\n\t d"]

    def sign(left):
        return rng.choice(["", "", "-", "+"] if left else ["", "", "-", "+"])

    def tag(kind):
        if kind == "print":
            return "{{%s 'x' %s}}" % (rng.choice(["", "-"]), rng.choice(["", "-"]))
        if kind == "comment":
            return "{#%s c %s#}" % (sign(True), sign(False))
        if kind == "set":
            return "{%%%s set v = 1 %s%%}" % (sign(True), sign(False))
        raise ValueError(kind)

    cases = []
    for i in range(count):
        parts = []
        depth = 0
        for _ in range(rng.randint(2, 9)):
            parts.append(rng.choice(texts))
            kind = rng.choice(["print", "comment", "set", "if", "end", "for"])
            if kind == "if":
                parts.append("{%%%s if true %s%%}" % (sign(True), sign(False)))
                depth += 1
            elif kind == "for":
                parts.append("{%%%s for i in [1, 2] %s%%}" % (sign(True), sign(False)))
                depth += 1
                parts.append(rng.choice(texts) + "{{ i }}")
                parts.append("{%%%s endfor %s%%}" % (sign(True), sign(False)))
                depth -= 1
            elif kind == "end" and depth > 0:
                parts.append("{%%%s endif %s%%}" % (sign(True), sign(False)))
                depth -= 1
            elif kind in ("print", "comment", "set"):
                parts.append(tag(kind))
        for _ in range(depth):
            parts.append(rng.choice(texts))
            parts.append("{%%%s endif %s%%}" % (sign(True), sign(False)))
        parts.append(rng.choice(texts))
        cases.append(("ws_random_%03d" % i, "".join(parts), {}))
    return cases


def write(path, text):
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)


def main():
    expected_dir = os.path.join(HERE, "expected")
    os.makedirs(expected_dir, exist_ok=True)
    for name in os.listdir(expected_dir):
        os.remove(os.path.join(expected_dir, name))

    entries = []
    for template, cases in template_cases().items():
        with open(os.path.join(HERE, template + ".jinja"), encoding="utf-8", newline="") as f:
            source = f.read()
        for case, ctx in cases:
            name = "%s.%s" % (template, case)
            out, err = render(source, ctx)
            entry = {"name": name, "template": template + ".jinja", "context": ctx}
            if err is None:
                entry["expected"] = "expected/%s.txt" % name
                write(os.path.join(expected_dir, name + ".txt"), out)
            else:
                entry["error"] = err[1]
                entry["error_type"] = err[0]
                entry["raised_by_template"] = err[2]
            if case.startswith("error_") != (err is not None):
                sys.exit("%s: %s" % (name, "expected an error" if err is None else err))
            entries.append(entry)
    write(os.path.join(HERE, "cases.json"), json.dumps(entries, indent=1, ensure_ascii=False) + "\n")

    language = []
    for name, source, ctx in LANGUAGE + random_whitespace_cases(300):
        out, err = render(source, ctx)
        entry = {"name": name, "template": source, "context": ctx}
        if err is None:
            entry["output"] = out
        else:
            entry["error"] = err[1]
            entry["error_type"] = err[0]
            entry["raised_by_template"] = err[2]
        if name.startswith("error_") != (err is not None):
            sys.exit("%s: %s" % (name, "expected an error" if err is None else err))
        language.append(entry)
    write(os.path.join(HERE, "language_cases.json"),
          json.dumps(language, indent=1, ensure_ascii=False) + "\n")
    print("jinja2 %s: %d template cases, %d language cases" % (jinja2.__version__, len(entries),
                                                              len(language)))


if __name__ == "__main__":
    main()
