"""Prompt templates Ollama publishes for popular model families (its template/*.gotmpl), with what they
render for three conversations (its template/testdata): test data for the Go template renderer."""

CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hello, how are you?"}],
    "user-assistant-user": [
        {"role": "user", "content": "Hello, how are you?"},
        {"role": "assistant", "content": "I'm doing great. How can I help you today?"},
        {"role": "user", "content": "I'd like to show off how chat templating works!"}],
    "system-user-assistant-user": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello, how are you?"},
        {"role": "assistant", "content": "I'm doing great. How can I help you today?"},
        {"role": "user", "content": "I'd like to show off how chat templating works!"}],
}

TEMPLATES = {
    'llama3-instruct': '{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>\n{{- end }}<|start_header_id|>assistant<|end_header_id|>\n\n',
    'chatml': '{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n',
    'gemma3-instruct': '{{- range $i, $_ := .Messages }}\n{{- $last := eq (len (slice $.Messages $i)) 1 }}\n{{- if eq .Role "user" }}<start_of_turn>user\n{{- if and (eq $i 1) $.System }}\n{{ $.System }}\n{{ end }}\n{{ .Content }}<end_of_turn>\n{{ else if eq .Role "assistant" }}<start_of_turn>model\n{{ .Content }}<end_of_turn>\n{{ end }}\n{{- if $last }}<start_of_turn>model\n{{ end }}\n{{- end }}\n',
    'phi-3': '{{- range .Messages }}<|{{ .Role }}|>\n{{ .Content }}<|end|>\n{{ end }}<|assistant|>\n',
    'mistral-instruct': '[INST] {{ range $index, $_ := .Messages }}\n{{- if eq .Role "system" }}{{ .Content }}\n\n{{ else if eq .Role "user" }}{{ .Content }}[/INST]\n{{- else if eq .Role "assistant" }} {{ .Content }}</s>[INST] {{ end }}\n{{- end }}',
    'alpaca': '{{- $system := "" }}\n{{- range .Messages }}\n{{- if eq .Role "system" }}\n{{- if not $system }}{{ $system = .Content }}\n{{- else }}{{ $system = printf "%s\\n\\n%s" $system .Content }}\n{{- end }}\n{{- else if eq .Role "user" }}\n{{- if $system }}{{ $system }}\n\n{{ $system = "" }}\n{{- end }}### Instruction:\n{{ .Content }}\n\n{{ else if eq .Role "assistant" }}### Response:\n{{ .Content }}\n\n{{ end }}\n{{- end }}### Response:\n',
}

RENDERED = {
    ('llama3-instruct', 'user'): '<|start_header_id|>user<|end_header_id|>\n\nHello, how are you?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n',
    ('llama3-instruct', 'user-assistant-user'): "<|start_header_id|>user<|end_header_id|>\n\nHello, how are you?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nI'm doing great. How can I help you today?<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nI'd like to show off how chat templating works!<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    ('llama3-instruct', 'system-user-assistant-user'): "<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHello, how are you?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nI'm doing great. How can I help you today?<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nI'd like to show off how chat templating works!<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    ('chatml', 'user'): '<|im_start|>user\nHello, how are you?<|im_end|>\n<|im_start|>assistant\n',
    ('chatml', 'user-assistant-user'): "<|im_start|>user\nHello, how are you?<|im_end|>\n<|im_start|>assistant\nI'm doing great. How can I help you today?<|im_end|>\n<|im_start|>user\nI'd like to show off how chat templating works!<|im_end|>\n<|im_start|>assistant\n",
    ('chatml', 'system-user-assistant-user'): "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHello, how are you?<|im_end|>\n<|im_start|>assistant\nI'm doing great. How can I help you today?<|im_end|>\n<|im_start|>user\nI'd like to show off how chat templating works!<|im_end|>\n<|im_start|>assistant\n",
    ('gemma3-instruct', 'user'): '<start_of_turn>user\nHello, how are you?<end_of_turn>\n<start_of_turn>model\n\n',
    ('gemma3-instruct', 'user-assistant-user'): "<start_of_turn>user\nHello, how are you?<end_of_turn>\n<start_of_turn>model\nI'm doing great. How can I help you today?<end_of_turn>\n<start_of_turn>user\nI'd like to show off how chat templating works!<end_of_turn>\n<start_of_turn>model\n\n",
    ('gemma3-instruct', 'system-user-assistant-user'): "<start_of_turn>user\nYou are a helpful assistant.\n\nHello, how are you?<end_of_turn>\n<start_of_turn>model\nI'm doing great. How can I help you today?<end_of_turn>\n<start_of_turn>user\nI'd like to show off how chat templating works!<end_of_turn>\n<start_of_turn>model\n\n",
    ('phi-3', 'user'): '<|user|>\nHello, how are you?<|end|>\n<|assistant|>\n',
    ('phi-3', 'user-assistant-user'): "<|user|>\nHello, how are you?<|end|>\n<|assistant|>\nI'm doing great. How can I help you today?<|end|>\n<|user|>\nI'd like to show off how chat templating works!<|end|>\n<|assistant|>\n",
    ('phi-3', 'system-user-assistant-user'): "<|system|>\nYou are a helpful assistant.<|end|>\n<|user|>\nHello, how are you?<|end|>\n<|assistant|>\nI'm doing great. How can I help you today?<|end|>\n<|user|>\nI'd like to show off how chat templating works!<|end|>\n<|assistant|>\n",
    ('mistral-instruct', 'user'): '[INST] Hello, how are you?[/INST]',
    ('mistral-instruct', 'user-assistant-user'): "[INST] Hello, how are you?[/INST] I'm doing great. How can I help you today?</s>[INST] I'd like to show off how chat templating works![/INST]",
    ('mistral-instruct', 'system-user-assistant-user'): "[INST] You are a helpful assistant.\n\nHello, how are you?[/INST] I'm doing great. How can I help you today?</s>[INST] I'd like to show off how chat templating works![/INST]",
    ('alpaca', 'user'): '### Instruction:\nHello, how are you?\n\n### Response:\n',
    ('alpaca', 'user-assistant-user'): "### Instruction:\nHello, how are you?\n\n### Response:\nI'm doing great. How can I help you today?\n\n### Instruction:\nI'd like to show off how chat templating works!\n\n### Response:\n",
    ('alpaca', 'system-user-assistant-user'): "You are a helpful assistant.\n\n### Instruction:\nHello, how are you?\n\n### Response:\nI'm doing great. How can I help you today?\n\n### Instruction:\nI'd like to show off how chat templating works!\n\n### Response:\n",
}
