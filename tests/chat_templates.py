"""Chat templates with tools and thinking, for tiny synthetic models (written into their GGUF metadata),
beside the Llama 3 and ChatML templates pyplugin.model.synth gives its models, which take tools already.

The Jinja ones follow the conventions of the families' own templates (Hugging Face's: `tools` as a list of
{"type": "function", "function": {...}}, calls in `message.tool_calls`, results under role "tool"), written
short. The Go ones are Ollama's published templates (from ollama's server/testdata/tools), test data for
reading the format from a template's text.
"""

# Any other template that takes tools: calls read as a JSON object with name and arguments.
PHI3_TOOLS = (
    "{% if tools %}<|system|>\nYou may call these functions: {{ tools | tojson }}. To call one, answer with "
    "{\"name\": ..., \"arguments\": {...}}.<|end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.tool_calls %}<|assistant|>\n{% for c in message.tool_calls %}{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}{% endfor %}<|end|>\n"
    "{% elif message.role == 'tool' %}<|user|>\nResult of {{ message.name }}: {{ message.content }}<|end|>\n"
    "{% else %}<|{{ message.role }}|>\n{{ message.content }}<|end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_QWEN_SYSTEM = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}"
    "\n\n# Tools\n\nYou may call one or more functions. Function signatures within <tools></tools>:\n<tools>"
    "{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n\nFor each call, return a JSON object with "
    "the function name and arguments within <tool_call></tool_call> tags:\n<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
)
_QWEN_MESSAGES = (
    "{% for message in messages %}"
    "{% if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content }}"
    "{% for c in message.tool_calls or [] %}\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n{% endif %}{% endfor %}"
)
# Qwen3: Qwen2.5's tools, and a reply that may open with <think>...</think>; enable_thinking=false writes an
# empty think block after the prompt.
QWEN3_THINKING = (
    _QWEN_SYSTEM + _QWEN_MESSAGES
    + "{% if add_generation_prompt %}<|im_start|>assistant\n"
      "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
      "{% endif %}"
)
# DeepSeek-R1's way: the prompt itself opens the think block, and the template has no switch.
OPENS_THINKING = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
    "{# a reply closes its reasoning with </think> #}"
)
# QwQ's way: no switch; the reasoning of earlier replies is dropped from the history.
DROPS_THINKING = (
    "{% for message in messages %}{% set content = message.content %}"
    "{% if message.role == 'assistant' and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] | trim %}{% endif %}"
    "<|im_start|>{{ message.role }}\n{{ content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Ollama's published Go templates (server/testdata/tools in ollama's repository).
OLLAMA_QWEN3_GO = (
    '{{- if .Messages }}\n{{- if or .System .Tools }}<|im_start|>system\n{{- if .System }}\n{{ .System }}\n'
    '{{- end }}\n{{- if .Tools }}\n\n# Tools\n\nYou may call one or more functions to assist with the user '
    'query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n'
    '{{- range .Tools }}\n{"type": "function", "function": {{ .Function }}}\n{{- end }}\n</tools>\n\nFor each '
    'function call, return a json object with function name and arguments within <tool_call></tool_call> XML '
    'tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n{{- end }}'
    '<|im_end|>\n{{ end }}\n{{- range $i, $_ := .Messages }}\n{{- $last := eq (len (slice $.Messages $i)) 1 -}}'
    '\n{{- if eq .Role "user" }}<|im_start|>user\n{{ .Content }}<|im_end|>\n{{ else if eq .Role "assistant" }}'
    '<|im_start|>assistant\n{{ if .Content }}{{ .Content }}\n{{- else if .ToolCalls }}<tool_call>\n'
    '{{ range .ToolCalls }}{"name": "{{ .Function.Name }}", "arguments": {{ .Function.Arguments }}}\n{{ end }}'
    '</tool_call>\n{{- end }}{{ if not $last }}<|im_end|>\n{{ end }}\n{{- else if eq .Role "tool" }}'
    '<|im_start|>user\n<tool_response>\n{{ .Content }}\n</tool_response><|im_end|>\n{{ end }}\n'
    '{{- if and (ne .Role "assistant") $last }}<|im_start|>assistant\n{{ end }}\n{{- end }}\n{{- else }}\n'
    '{{- if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}{{ if .Prompt }}<|im_start|>user\n'
    '{{ .Prompt }}<|im_end|>\n{{ end }}<|im_start|>assistant\n{{ end }}{{ .Response }}{{ if .Response }}'
    '<|im_end|>{{ end }}'
)
OLLAMA_LLAMA32_GO = (
    '<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n\n{{ if .System }}'
    '{{ .System }}\n{{- end }}\n{{- if .Tools }}When you receive a tool call response, use the output to format '
    'an answer to the orginal user question.\n\nYou are a helpful assistant with tool calling capabilities.\n'
    '{{- end }}<|eot_id|>\n{{- range $i, $_ := .Messages }}\n{{- $last := eq (len (slice $.Messages $i)) 1 }}\n'
    '{{- if eq .Role "user" }}<|start_header_id|>user<|end_header_id|>\n{{- if and $.Tools $last }}\n\nGiven the '
    'following functions, please respond with a JSON for a function call with its proper arguments that best '
    'answers the given prompt.\n\nRespond in the format {"name": function name, "parameters": dictionary of '
    'argument name and its value}. Do not use variables.\n\n{{ range $.Tools }}\n{{- . }}\n{{ end }}\n'
    '{{ .Content }}<|eot_id|>\n{{- else }}\n\n{{ .Content }}<|eot_id|>\n{{- end }}{{ if $last }}'
    '<|start_header_id|>assistant<|end_header_id|>\n\n{{ end }}\n{{- else if eq .Role "assistant" }}'
    '<|start_header_id|>assistant<|end_header_id|>\n{{- if .ToolCalls }}\n{{ range .ToolCalls }}\n'
    '{"name": "{{ .Function.Name }}", "parameters": {{ .Function.Arguments }}}{{ end }}\n{{- else }}\n\n'
    '{{ .Content }}\n{{- end }}{{ if not $last }}<|eot_id|>{{ end }}\n{{- else if eq .Role "tool" }}'
    '<|start_header_id|>ipython<|end_header_id|>\n\n{{ .Content }}<|eot_id|>{{ if $last }}'
    '<|start_header_id|>assistant<|end_header_id|>\n\n{{ end }}\n{{- end }}\n{{- end }}'
)
