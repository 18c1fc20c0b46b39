"""Benchmarks behind ``polykv-agents bench``: one module per suite (``memory``, ``speed``, ``quality``,
``ablation``, ``peer``, ``agents``), each returning a :class:`~.output.SuiteResult` of measured rows;
:mod:`.writers` turns a result into its Markdown table and plots."""
