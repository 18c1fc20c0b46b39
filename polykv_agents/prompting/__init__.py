"""Turning conversations into token ids: the chat template, tool calls and where tools are shown.

- :mod:`~polykv_agents.prompting.chat_template`: render messages, and a call's turns as a continuation
  of the pool's prefix.
- :mod:`~polykv_agents.prompting.tool_calls`: the tool-call format, its grammar and its parser.
- :mod:`~polykv_agents.prompting.tool_prompts`: show tools through the template's own support or a
  documented system message.
- :mod:`~polykv_agents.prompting.encode`: one call's prompt token ids (the entry point of the room).
"""
