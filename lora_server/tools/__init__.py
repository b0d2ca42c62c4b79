"""Tool calling: what a chat request asks of tools (``spec``), the tool list and the tool-call history in the chat
template, or rendered into the system prompt when the template cannot show them (``prompt``), the model families'
tool-call formats (``parsers``, a registry), the grammars that force calls (``grammar``) and reading calls out of
the output text as it streams (``readers``). Nothing here imports the web stack or xgrammar."""
