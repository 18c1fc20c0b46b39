"""LangChain's side: :class:`~polykv_agents.chat.chat_model.ChatPolyKV`, message conversion, structured
output and the bridge that serves async callers from the decoding thread."""
